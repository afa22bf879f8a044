"""The train stage's recipe: which models it fits, decided by params, and the one ``model.pt`` they make.

- ``tiles.use: auto`` where the prepare stage cut labeled tiles (the data has defect masks; prepare.json
  records it under ``tiles``): the ``train.ensemble`` members in ``tiles.keep_members``, then the tile
  model (``tiles.recipe``) on ``data/prepared/tiles``;
- else ``train.ensemble`` members (all of them), or with ``train.ensemble: 1`` a single model.

Each member (and the tile model) is a whole training run of its own (``pipeline.training.fit``: seed
``train.seed + k``; checkpoints, model, curves and MLflow run under ``checkpoints/member-k`` or
``checkpoints/tiles``), so a killed run resumes inside the member it was in and finished members are not
trained again. ``pack`` then writes ``model.pt`` holding them all (an ``Ensemble``; the tile model beside
it, read by ``pipeline.model.load_tile_model``) and ``run.json`` naming the model's MLflow run, into
which the later stages log as they do for a single model.

MLflow: the model's run (``tracking.run_name``) is opened before the first member trains; each member's
and the tile model's run is nested under it (``member-<k>``, ``tile-model``). The model's run holds the
params, lineage, the per-epoch curves of the first member (``CURVE_METRICS``, step = epoch, logged as it
trains), the packed model's val figures, the plots and ``model/model.pt``. A single network (no ensemble,
no tiles) is its own model run, with nothing nested.

At the start the recipe is printed and written to ``reports/train/recipe.json`` (and the model's run):
each training run with its epochs and images per epoch; after the first epoch trained, the expected time
of the rest from the images/s measured in it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline import checkpoint, distributed, tracking
from pipeline.config import Params, as_flat_dict, member_params, tile_params
from pipeline.data.prepare import load_groups, load_split, ok_index, read_summary
from pipeline.distributed import Dist
from pipeline.model import MODEL_META, load_model, save_model
from pipeline.plots import members_curves_plot
from pipeline.runtime import Runtime, resolve_runtime
from pipeline.training.fit import (
    CURVES,
    RunSpec,
    evaluate_arrays,
    fit,
    open_model_run,
    read_history,
    training_fingerprint,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    members: list[int] | None  # the train.ensemble members fitted; None: a single model (train.ensemble 1)
    tiles: bool  # a tile model too
    reason: str  # why, in words (tiles.use and what it resolved to)


def decide(params: Params, prepared_dir: Path) -> Recipe:
    """The recipe from params; ``tiles.use: auto`` resolves to what the prepare stage recorded in
    prepare.json (tiles cut, or why not: ``pipeline.data.tiling.tile_data``)."""
    prepared = read_summary(prepared_dir)
    why = prepared.get("tiles_reason") or f"tiles.use {params.tiles.use}"
    if params.tiles.use == "auto" and prepared.get("tiles"):
        return Recipe(list(params.tiles.keep_members), True, why)
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
    plan = Plan.of(params, recipe, prepared_dir, reports_dir / "recipe.json")
    if d.is_main:
        plan.announce()
    try:
        if recipe.members is None:
            spec = RunSpec(plan.name, tags=plan.tags(), on_epoch=plan.on_epoch(0, None))
            summary = fit(params, prepared_dir, out_dir, reports_dir, data_reports, rt, d, spec)
            if summary is not None:
                plan.finish()
        else:
            summary = train_members(params, recipe, plan, prepared_dir, out_dir, reports_dir, data_reports, rt, d)
    finally:
        d.close()
    return summary


# The per-epoch figures of the first member that the model's run shows as its curves (step = epoch).
CURVE_METRICS = ("train_loss", "val_loss", "train_acc", "val_acc", "val_auc", "val_recall_at_far")


def epoch_images(labels: np.ndarray, majority_per_epoch: float) -> int:
    """Images one epoch draws (``loop.EpochBatches``): every image but the most frequent class's, of which
    ``majority_per_epoch``."""
    counts = np.bincount(labels)
    return int(len(labels) - counts.max() + round(majority_per_epoch * counts.max()))


def data_fingerprint(prepared_dir: Path) -> str:
    """sha256 of the prepared data itself (its summary and the train, val and test images and labels): the
    same for every model trained on it, whatever the params."""
    h = hashlib.sha256()
    for name in ("prepare.json", "train.npz", "val.npz", "test.npz"):
        if (prepared_dir / name).is_file():
            h.update((prepared_dir / name).read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Part:
    """One training run of the recipe."""

    name: str  # member-<k>, tile-model; the MLflow child run's name
    model: str
    epochs: int
    images_per_epoch: int


class Plan:
    """The recipe resolved to training runs, said at the start (``announce``), with the expected time of the
    rest after the first epoch trained (``on_epoch``), in ``recipe.json`` and the model's MLflow run."""

    def __init__(self, recipe: Recipe, parts: list[Part], name: str, data_fp: str, path: Path) -> None:
        self.recipe, self.parts, self.name, self.data_fp, self.path = recipe, parts, name, data_fp, path
        self.expected_min: float | None = None
        self.curve_steps: set[int] = set()  # epochs of the first member logged live into the model's run

    @classmethod
    def of(cls, params: Params, recipe: Recipe, prepared_dir: Path, path: Path) -> Plan:
        def part(name: str, p: Params, folder: Path) -> Part:
            with np.load(folder / "train.npz") as z:  # the labels only: an npz reads each array on demand
                labels = z["labels"]
            extra = folder.parent / "augmented" / "extra.npz"
            if extra.is_file():
                with np.load(extra) as z:
                    labels = np.concatenate([labels, z["labels"]])
            return Part(name, p.model.name, p.train.epochs, epoch_images(labels, p.train.majority_per_epoch))

        if recipe.members is None:
            parts = [part("model", params, prepared_dir)]
        else:
            parts = [part(f"member-{k}", member_params(params, k), prepared_dir) for k in recipe.members]
        if recipe.tiles:
            parts.append(part("tile-model", tile_params(params), prepared_dir / "tiles"))
        nets = sorted({p.model for p in parts if p.name != "tile-model"})
        label = (nets[0] if len(nets) == 1 else "mixed") if nets else "tiles"
        if recipe.members is not None and len(recipe.members) > 1:
            label = f"{len(recipe.members)}x{label}"
        label += "+tiles" if recipe.tiles else ""
        fp = data_fingerprint(prepared_dir)
        return cls(recipe, parts, tracking.run_name(label, read_summary(prepared_dir)["image_size"], fp), fp, path)

    def report(self) -> dict:
        return {
            **asdict(self.recipe),
            "runs": [asdict(p) for p in self.parts],
            "epochs": sum(p.epochs for p in self.parts),
            "images": sum(p.epochs * p.images_per_epoch for p in self.parts),
            "expected_minutes": self.expected_min,
        }

    def tags(self) -> dict[str, str]:
        runs = ", ".join(f"{p.name} {p.epochs} epochs x {p.images_per_epoch} images" for p in self.parts)
        return {"recipe": runs, "recipe.reason": self.recipe.reason, "data.fingerprint": self.data_fp}

    def announce(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.report(), indent=2) + "\n")
        r = self.report()
        print(f"train: {self.tags()['recipe']} ({self.recipe.reason}); {r['images']:,} images in all", flush=True)

    def on_epoch(self, i: int, parent: tracking.Run | None):
        """The hook ``fit`` calls after each epoch of part ``i``: the first member's curves into the model's
        run (``parent``, when the part runs nested under it), and once, the expected time."""

        def hook(run: tracking.Run, row: dict) -> None:
            if parent is not None and i == 0:
                parent.log_metrics({k: row[k] for k in CURVE_METRICS if k in row}, step=int(row["epoch"]))
                self.curve_steps.add(int(row["epoch"]))
            if self.expected_min is None and row.get("train_img_s"):
                self.expect(i, int(row["epoch"]), row["train_img_s"], parent or run)

        return hook

    def expect(self, i: int, epoch: int, img_s: float, run: tracking.Run) -> None:
        part = self.parts[i]
        left = (part.epochs - epoch) * part.images_per_epoch
        left += sum(p.epochs * p.images_per_epoch for p in self.parts[i + 1 :])
        self.expected_min = round(left / img_s / 60, 1)
        print(
            f"train: {part.name} epoch {epoch} at {img_s:.0f} img/s: expected ~{self.expected_min:.0f} min "
            f"for the remaining {left:,} images (plus validation)",
            flush=True,
        )
        self.path.write_text(json.dumps(self.report(), indent=2) + "\n")
        run.set_tags({"train.expected_minutes": self.expected_min})

    def finish(self) -> None:
        self.path.write_text(json.dumps(self.report(), indent=2) + "\n")


def model_run_key(params: Params, recipe: Recipe, prepared_dir: Path) -> str:
    """What makes the model's run the same one again (a killed or re-run stage continues it): the training
    fingerprint of the params, code and data, the tile params and the recipe. Known before any training."""
    h = hashlib.sha256(training_fingerprint(params, prepared_dir).encode())
    h.update(json.dumps([asdict(recipe), as_flat_dict(params.tiles)], sort_keys=True, default=str).encode())
    return h.hexdigest()


@contextlib.contextmanager
def model_run(
    params: Params, plan: Plan, prepared_dir: Path, out_dir: Path, data_reports: Path | None, d: Dist
) -> Iterator[tracking.Run | None]:
    """Rank 0: the model's MLflow run of an ensemble or a tile model, open while its parts train nested under
    it; continued when ``checkpoints/model-run.json`` names it for the same ``model_run_key``. Other ranks:
    None."""
    if not d.is_main:
        yield None
        return
    known = out_dir / "checkpoints" / "model-run.json"
    key = model_run_key(params, plan.recipe, prepared_dir)
    previous = json.loads(known.read_text()) if known.is_file() else {}
    run_id = previous.get("run_id") if previous.get("key") == key else None
    with open_model_run(params, run_id, plan.name, plan.tags(), data_reports) as run:
        known.parent.mkdir(parents=True, exist_ok=True)
        known.write_text(json.dumps({"run_id": run.run_id, "key": key}) + "\n")
        run.log_artifacts(plan.path, "train")
        yield run


def train_members(
    params: Params,
    recipe: Recipe,
    plan: Plan,
    prepared_dir: Path,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    rt: Runtime,
    d: Dist,
) -> dict | None:
    """Fit the recipe's members one after the other, then its tile model, each nested under the model's run;
    rank 0 packs them (``pack``)."""
    cfg = params.train
    members = []
    with model_run(params, plan, prepared_dir, out_dir, data_reports, d) as parent:
        parent_id = parent.run_id if parent is not None else ""
        for i, k in enumerate(recipe.members):
            where = out_dir / "checkpoints" / f"member-{k}"
            changes = cfg.ensemble_members[k] if cfg.ensemble_members else {}
            log.info(
                "ensemble member %d of %d (train.seed %d%s)",
                k + 1,
                cfg.ensemble,
                cfg.seed + k,
                "".join(f", {key} changed" for key in changes),
            )
            spec = RunSpec(f"member-{k}", parent_id, {"member": k}, plan.on_epoch(i, parent))
            summary = fit(member_params(params, k), prepared_dir, where, where / "reports", data_reports, rt, d, spec)
            members.append((where, summary))
        tiles = None
        if recipe.tiles:
            where = out_dir / "checkpoints" / "tiles"
            log.info("the tile model (tiles.recipe: %s)", ", ".join(f"{k} {v}" for k, v in params.tiles.recipe.items()))
            spec = RunSpec("tile-model", parent_id, {"member": "tiles"}, plan.on_epoch(len(recipe.members), parent))
            tiles = (
                where,
                fit(tile_params(params), prepared_dir / "tiles", where, where / "reports", None, rt, d, spec),
            )
        if not d.is_main:
            return None
        summary, fingerprint = pack(params, recipe.members, members, tiles, prepared_dir, out_dir, reports_dir, rt)
        plan.finish()
        record_run(parent, plan, recipe.members, members, tiles, summary, fingerprint, out_dir, reports_dir)
    return summary


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
    rt: Runtime,
) -> tuple[dict, str]:
    """Rank 0: ``model.pt`` of every member (and the tile model beside them), judged on val as one model;
    its curves and metrics (returned with the packed model's fingerprint)."""
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
    log.info(
        "ensemble of %d: val accuracy %.3f, val AUC %.3f, val recall at %.0f%% false alarms %.3f",
        len(metas),
        val["val_acc"],
        val["val_auc"],
        100 * params.evaluate.max_false_alarm_rate,
        val["val_recall_at_far"],
    )
    return summary, fingerprint


def validate_packed(params: Params, model_file: Path, prepared_dir: Path, rt: Runtime) -> dict:
    """The packed ensemble's own val figures (the tile model aside: its figures are by tile)."""
    net, _ = load_model(model_file)
    net = net.to(rt.device)  # load_model builds on the CPU; the val arrays go to rt.device (a GPU: found on an H200)
    info = read_summary(prepared_dir)
    x_va, y_va, _ = load_split(prepared_dir, "val")
    far, groups = params.evaluate.max_false_alarm_rate, load_groups(prepared_dir, "val")
    return evaluate_arrays(net, x_va, y_va, rt, Dist("none"), nn.CrossEntropyLoss(), ok_index(info), far, groups)


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
    run: tracking.Run,
    plan: Plan,
    ks: list[int],
    members: list[tuple[Path, dict]],
    tiles: tuple[Path, dict] | None,
    summary: dict,
    fingerprint: str,
    out_dir: Path,
    reports_dir: Path,
) -> None:
    """The packed model into its MLflow run: its val figures (``model_val_*``), the first member's curves
    where they were not logged live (a member finished earlier, under another model's run), the plots and
    reports, model.pt and tags naming each nested run; ``run.json`` names the run for the later stages."""
    tags = {
        f"member_{k}.run_id": json.loads((w / "run.json").read_text())["run_id"]
        for k, (w, _) in zip(ks, members, strict=True)
    }
    if tiles:
        tags["tiles.run_id"] = json.loads((tiles[0] / "run.json").read_text())["run_id"]
    run.set_tags(tags | {"train.fingerprint": fingerprint})
    if run.new:
        for row in read_history(members[0][0] / "reports/history.csv"):
            if int(row["epoch"]) not in plan.curve_steps:
                run.log_metrics({k: row[k] for k in CURVE_METRICS if k in row}, step=int(row["epoch"]))
    # the packed model's own val figures as model_val_*: val_* are the first member's curves
    figures = {k: v for k, v in summary.items() if isinstance(v, float | int) and not isinstance(v, bool)}
    run.log_metrics({f"model_{k}" if k.startswith("val_") else k: v for k, v in figures.items()})
    run.log_artifacts(reports_dir, "train")
    run.log_artifacts(out_dir / "model.pt", "model")
    (out_dir / "run.json").write_text(json.dumps({"run_id": run.run_id, "fingerprint": fingerprint}) + "\n")
