"""The train stage's recipe: which models it fits, decided by params, and the one ``model.pt`` they make.

- ``tiles.use: auto`` where the prepare stage cut labeled tiles (the data has defect masks; prepare.json
  records it under ``tiles``): the ``train.ensemble`` members in ``tiles.keep_members``, then the tile
  model (``tiles.recipe``) on ``data/prepared/tiles``;
- else ``train.ensemble`` members (all of them), or with ``train.ensemble: 1`` a single model.

Each member (and the tile model) is a whole training run of its own (``pipeline.training.fit``: seed
``train.seed + k``; checkpoints, model, curves and MLflow run under ``checkpoints/member-k`` or
``checkpoints/tiles``), so a killed run resumes inside the member it was in and finished members are not
trained again. ``pack`` then writes ``model.pt`` holding them all (an ``Ensemble``; the tile model beside
it, read by ``pipeline.model.load_tile_model``) and ``run.json`` naming the ensemble's MLflow run, into
which the later stages log as they do for a single model. What the recipe resolved to is written to
``reports/train/recipe.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline import checkpoint, distributed
from pipeline.config import Params, member_params, tile_params
from pipeline.data.prepare import load_groups, load_split, read_summary
from pipeline.distributed import Dist
from pipeline.model import MODEL_META, load_model, save_model
from pipeline.plots import members_curves_plot
from pipeline.runtime import Runtime, resolve_runtime
from pipeline.training.fit import CURVES, evaluate_arrays, fit, open_train_run, read_history

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    members: list[int] | None  # the train.ensemble members fitted; None: a single model (train.ensemble 1)
    tiles: bool  # a tile model too
    reason: str  # why, in words (tiles.use and what it resolved to)


def decide(params: Params, prepared_dir: Path) -> Recipe:
    """The recipe from params; ``tiles.use: auto`` resolves to what the prepare stage recorded (tiles cut
    where the data has defect masks that cover a training tile)."""
    cut = read_summary(prepared_dir).get("tiles")
    if params.tiles.use == "auto" and cut:
        why = f"tiles.use auto: the data has defect masks ({cut['train_tiles']['defect']} defect training tiles)"
        return Recipe(list(params.tiles.keep_members), True, why)
    why = "tiles.use off" if params.tiles.use == "off" else "tiles.use auto: no defect masks cover a training tile"
    members = None if params.train.ensemble == 1 else list(range(params.train.ensemble))
    return Recipe(members, False, why)


def train(
    params: Params, prepared_dir: Path, out_dir: Path, reports_dir: Path, data_reports: Path | None = None
) -> dict | None:
    """Train what the recipe says (rank 0 returns the summary, other ranks None). ``data_reports``: the
    folder holding ``validate/`` and ``augment/`` reports, logged into the run so it shows what data it
    learned from."""
    cfg = params.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rt = resolve_runtime(cfg.device, cfg.precision)
    d = distributed.init(cfg.distributed, rt.device.type)
    if rt.device.type == "cuda" and d.enabled:
        rt.device = torch.device("cuda", d.local_rank)
    if not d.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    recipe = decide(params, prepared_dir)
    log.info("recipe: %s; %s", describe(recipe, params), recipe.reason)
    try:
        if recipe.members is None:
            summary = fit(params, prepared_dir, out_dir, reports_dir, data_reports, rt, d)
        else:
            summary = train_members(params, recipe, prepared_dir, out_dir, reports_dir, data_reports, rt, d)
    finally:
        d.close()
    if summary is not None:
        (reports_dir / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    return summary


def describe(recipe: Recipe, params: Params) -> str:
    whole = "one model" if recipe.members is None else f"members {recipe.members} of {params.train.ensemble}"
    return whole + (" + a tile model" if recipe.tiles else "")


def train_members(
    params: Params,
    recipe: Recipe,
    prepared_dir: Path,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    rt: Runtime,
    d: Dist,
) -> dict | None:
    """Fit the recipe's members one after the other, then its tile model; rank 0 packs them (``pack``)."""
    cfg = params.train
    members = []
    for k in recipe.members:
        where = out_dir / "checkpoints" / f"member-{k}"
        changes = cfg.ensemble_members[k] if cfg.ensemble_members else {}
        log.info(
            "ensemble member %d of %d (train.seed %d%s)",
            k + 1,
            cfg.ensemble,
            cfg.seed + k,
            "".join(f", {key} changed" for key in changes),
        )
        members.append(
            (where, fit(member_params(params, k), prepared_dir, where, where / "reports", data_reports, rt, d))
        )
    tiles = None
    if recipe.tiles:
        where = out_dir / "checkpoints" / "tiles"
        log.info("the tile model (tiles.recipe: %s)", ", ".join(f"{k} {v}" for k, v in params.tiles.recipe.items()))
        tiles = (where, fit(tile_params(params), prepared_dir / "tiles", where, where / "reports", data_reports, rt, d))
    if not d.is_main:
        return None
    return pack(params, recipe.members, members, tiles, prepared_dir, out_dir, reports_dir, data_reports, rt)


def _read_member(where: Path, what: str) -> dict:
    ckpt = checkpoint.load(where / "model.pt")
    if ckpt is None:
        raise FileNotFoundError(f"{where / 'model.pt'}: {what} is unreadable; delete {where}")
    return ckpt


def pack(
    params: Params,
    ks: list[int],
    members: list[tuple[Path, dict]],
    tiles: tuple[Path, dict] | None,
    prepared_dir: Path,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    rt: Runtime,
) -> dict:
    """Rank 0: ``model.pt`` of every member (and the tile model beside them), judged on val as one model;
    its curves, metrics and MLflow run."""
    cfg = params.train
    ckpts = [_read_member(where, "an ensemble member's model") for where, _ in members]
    states, metas = [c["model"] for c in ckpts], [c["meta"] for c in ckpts]
    packed_tiles = None
    if tiles:
        ckpt = _read_member(tiles[0], "the tile model")
        tile_side = read_summary(prepared_dir / "tiles")["image_size"]
        packed_tiles = {
            "model": ckpt["model"],
            "meta": {**ckpt["meta"], "weight": params.tiles.weight, "tile": tile_side},
        }
    digest = hashlib.sha256("".join(m["fingerprint"] for m in metas).encode())
    if packed_tiles:
        digest.update(f"tiles {packed_tiles['meta']['fingerprint']} {params.tiles.weight}".encode())
    fingerprint = digest.hexdigest()
    names = [m["architecture"] for m in metas]
    meta = {
        **metas[0],
        # one name when every member is the same network; else each member's, in order (the model card's)
        "architecture": names[0] if len(set(names)) == 1 else " + ".join(names),
        "member_models": [{key: m[key] for key in MODEL_META} for m in metas],
        "fingerprint": fingerprint,
        "members": len(metas),
        "member_seeds": [cfg.seed + k for k in ks],
        "member_changes": [cfg.ensemble_members[k] for k in ks] if cfg.ensemble_members else [],
        "member_epochs": [m["epoch"] for m in metas],
    }
    state = {f"members.{k}.{name}": v for k, s in enumerate(states) for name, v in s.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(state, meta, out_dir / "model.pt", packed_tiles)
    val = validate_packed(params, out_dir / "model.pt", prepared_dir, rt)
    summary = members_summary(metas, members, val, reports_dir, rt)
    if tiles:
        summary |= tiles_summary(params, tiles, prepared_dir)
    (reports_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    record_run(params, ks, members, tiles, fingerprint, summary, out_dir, reports_dir, data_reports, prepared_dir)
    log.info(
        "ensemble of %d: val AUC %.3f, val recall at %.0f%% false alarms %.3f",
        len(metas),
        val["val_auc"],
        100 * params.evaluate.max_false_alarm_rate,
        val["val_recall_at_far"],
    )
    return summary


def validate_packed(params: Params, model_file: Path, prepared_dir: Path, rt: Runtime) -> dict:
    """The packed ensemble's own val figures (the tile model aside: its figures are by tile)."""
    net, _ = load_model(model_file)
    net = net.to(rt.device)  # load_model builds on the CPU; the val arrays go to rt.device (a GPU: found on an H200)
    info = read_summary(prepared_dir)
    x_va, y_va, _ = load_split(prepared_dir, "val")
    ok_index = info["classes"].index(info["ok_class"])
    far, groups = params.evaluate.max_false_alarm_rate, load_groups(prepared_dir, "val")
    return evaluate_arrays(net, x_va, y_va, rt, Dist("none"), nn.CrossEntropyLoss(), ok_index, far, groups)


def members_summary(
    metas: list[dict], members: list[tuple[Path, dict]], val: dict, reports_dir: Path, rt: Runtime
) -> dict:
    """history.csv is member 0's (one row per epoch, as DVC plots expects); the PNGs show every member,
    and the ensemble's own val figures beside theirs."""
    reports_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(members[0][0] / "reports/history.csv", reports_dir / "history.csv")
    histories = [read_history(where / "reports/history.csv") for where, _ in members]
    for keys, title, name in CURVES:
        members_curves_plot(histories, keys, title, reports_dir / name, final=val)
    return {
        "ensemble": len(metas),
        **{k: float(v) for k, v in val.items()},
        "steps": sum(s["steps"] for _, s in members),
        "train_images": members[0][1]["train_images"],
        "train_img_s": float(np.median([s["train_img_s"] for _, s in members])),
        "device": str(rt.device),
        "precision": rt.precision,
        "members": [s for _, s in members],
    }


def tiles_summary(params: Params, tiles: tuple[Path, dict], prepared_dir: Path) -> dict:
    """The tile model's own figures (by tile; the fused ones come from the evaluate stage) and its fit check."""
    info = read_summary(prepared_dir)
    ok_index = info["classes"].index(info["ok_class"])
    with np.load(prepared_dir / "tiles/train.npz") as z:
        labels = z["labels"]
    tp = tile_params(params)
    fit_ = fit_check(tiles[0] / "reports/history.csv", labels, ok_index, tp.train.majority_per_epoch)
    return {
        "tiles": {**tiles[1], **fit_, "architecture": tp.model.name},
        "tiles_train_img_s": float(tiles[1]["train_img_s"]),
        "tiles_val_auc": float(fit_["tile_val_auc"]),
        "tiles_model_fit": int(fit_["tile_model_fit"]),
    }


def fit_check(history: Path, train_labels: np.ndarray, ok_index: int, ok_share: float) -> dict:
    """Did the tile model learn? Its last epoch's train accuracy against the share of OK tiles in an epoch
    (a model that calls every tile OK scores that share). From scratch, a few hundred defect tiles among
    thousands of clean ones sometimes never leave that plateau (measured: README); the run then says so."""
    last = read_history(history)[-1]
    n_ok = int((train_labels == ok_index).sum())
    n_defect = int(((train_labels >= 0) & (train_labels != ok_index)).sum())
    share = ok_share * n_ok / (ok_share * n_ok + n_defect)
    fit_ = {
        "tile_train_accuracy": last["train_acc"],
        "tile_val_auc": last.get("val_auc", float("nan")),
        "epoch_ok_share": share,
        "tile_model_fit": bool(last["train_acc"] >= share + 0.05),
    }
    if not fit_["tile_model_fit"]:
        log.warning(
            "the tile model did not fit: train accuracy %.2f at the last epoch, where calling every "
            "tile OK scores %.2f; its figures are a failed training's (try a lower train.lr in "
            "tiles.recipe, or another train.seed)",
            last["train_acc"],
            share,
        )
    return fit_


def record_run(
    params: Params,
    ks: list[int],
    members: list[tuple[Path, dict]],
    tiles: tuple[Path, dict] | None,
    fingerprint: str,
    summary: dict,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    prepared_dir: Path,
) -> None:
    """The ensemble's MLflow run (the same members again: the same run), its tags naming each member's run;
    ``run.json`` names it for the later stages."""
    run_ids = [json.loads((where / "run.json").read_text())["run_id"] for where, _ in members]
    known = out_dir / "checkpoints" / "ensemble-run.json"
    previous = json.loads(known.read_text()) if known.is_file() else {}
    tags = {f"member_{k}.run_id": r for k, r in zip(ks, run_ids, strict=True)}
    if tiles:
        tags["tiles.run_id"] = json.loads((tiles[0] / "run.json").read_text())["run_id"]
    run_id = previous.get("run_id") if previous.get("fingerprint") == fingerprint else None
    label = f"{read_summary(prepared_dir)['image_size']}px-ensemble{len(members)}" + ("+tiles" if tiles else "")
    with open_train_run(params, run_id, label, fingerprint, tags, data_reports) as run:
        run.log_metrics({k: v for k, v in summary.items() if isinstance(v, float | int)})
        run.log_artifacts(reports_dir, "train")
        run.log_artifacts(out_dir / "model.pt", "model")
        run_file = {"run_id": run.run_id, "fingerprint": fingerprint}
    known.write_text(json.dumps(run_file) + "\n")
    (out_dir / "run.json").write_text(json.dumps(run_file) + "\n")
