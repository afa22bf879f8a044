"""Train: a timm EfficientNet on the packed images; checkpointed, resumable, single or multi-process.

``train()`` reads as the recipe: resolve device and precision, join the process group, build data,
model, optimizer and schedule, resume from the newest good checkpoint, then run epochs. The step loop
itself is ``pipeline.loop.train_one_epoch``; checkpoint files are ``pipeline.checkpoint``.

A checkpoint holds everything a resumed run needs to continue exactly where the killed one was:
model, optimizer, LR schedule, loss scaler, EMA weights, epoch and step inside the epoch, each rank's
RNG state and running sums, the best monitored val score, the early-stopping count, history, the MLflow run id and
a fingerprint of the params and data. Only rank 0 logs, writes files and talks to MLflow.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from pipeline import checkpoint, distributed, tracking
from pipeline.augment import ImageDataset, build_policy, resolve_policy
from pipeline.config import ConfigError, Params, as_flat_dict, member_params, tile_params
from pipeline.distributed import Dist, unwrap
from pipeline.loop import (
    EMA,
    EpochBatches,
    EpochProgress,
    FocalLoss,
    MaskLoss,
    RankingLoss,
    predict_logits,
    train_one_epoch,
)
from pipeline.metrics import binary_metrics, group_weights, roc_auc, softmax, threshold_for_false_alarms
from pipeline.model import DefectNet, Ensemble, create_model
from pipeline.plots import curves_plot, members_curves_plot
from pipeline.prepare import MASK_UNKNOWN, load_groups, load_masks, load_split, read_summary
from pipeline.runtime import Runtime, resolve_runtime
from pipeline.warmstart import WarmStart, resolve_init

log = logging.getLogger(__name__)

# The curves every training run draws from its per-epoch history: (keys, title, file).
CURVES = [
    (["train_loss", "val_loss", "train_mask_loss"], "loss", "loss.png"),
    (["train_acc", "val_acc"], "accuracy", "accuracy.png"),
    (["val_auc", "val_recall_at_far"], "defect vs OK on val", "val_defect.png"),
]


def read_history(path: Path) -> list[dict]:
    """A run's history.csv back as per-epoch dicts of numbers."""
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


# train.* keys that change how a run is carried out, not the weights it ends with.
OPERATIONAL_KEYS = {"keep_last", "keep_best", "on_mismatch", "num_workers", "threads", "checkpoint_every_steps"}


def load_train_split(prepared_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The training images plus the augment stage's balancing copies (``data/augmented/extra.npz``)."""
    x, y, _ = load_split(prepared_dir, "train")
    extra = prepared_dir.parent / "augmented" / "extra.npz"
    if extra.is_file():
        with np.load(extra) as z:
            if len(z["labels"]):
                x, y = np.concatenate([x, z["images"]]), np.concatenate([y, z["labels"]])
    return x, y


def train_masks(prepared_dir: Path, n: int) -> np.ndarray | None:
    """The training split's defect masks for ``train.mask_loss``, the balancing copies' marked unknown (they
    are augmented without their masks); None when no training image has a known mask (nothing to learn
    where a defect is from, so no mask head is trained)."""
    masks = load_masks(prepared_dir, "train")
    if masks is None or not (masks != MASK_UNKNOWN).any():
        log.info("train.mask_loss: no defect masks in the prepared data (<source>_masks); classifier alone")
        return None
    if n > len(masks):
        masks = np.concatenate([masks, np.full((n - len(masks), *masks.shape[1:]), MASK_UNKNOWN, np.uint8)])
    known = (masks != MASK_UNKNOWN).any(axis=(1, 2))
    log.info("train.mask_loss: masks known for %d of %d training images", int(known.sum()), n)
    return masks


# The code that shapes the weights: a checkpoint written by other code is not resumed (DVC reruns the
# stage when this code changes, and a finished checkpoint would otherwise just be handed back).
TRAINING_CODE = [
    "train.py",
    "loop.py",
    "model.py",
    "augment.py",
    "runtime.py",
    "distributed.py",
    "warmstart.py",
    "metrics.py",
]


def fingerprint(params: Params, prepared_dir: Path, init: str = "") -> str:
    """sha256 over the params and code that shape the weights, the bytes of the training data and the
    identity of the warm-start weights (``init``)."""
    h = hashlib.sha256(init.encode())
    for name in TRAINING_CODE:
        h.update((Path(__file__).parent / name).read_bytes())
    train = {k: v for k, v in as_flat_dict(params.train).items() if k not in OPERATIONAL_KEYS}
    monitor = {"max_false_alarm_rate": params.evaluate.max_false_alarm_rate}  # what val_recall_at_far means
    sections = (as_flat_dict(params.model), train, as_flat_dict(params.augment), as_flat_dict(params.prepare), monitor)
    for section in sections:
        h.update(json.dumps(section, sort_keys=True, default=str).encode())
    for path in (prepared_dir / "train.npz", prepared_dir / "val.npz", prepared_dir.parent / "augmented/extra.npz"):
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def warmup_cosine(warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def class_weights(labels: np.ndarray, num_classes: int) -> torch.Tensor:
    """Inverse-frequency weights, mean 1: a rare defect class counts as much as the OK class."""
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    w = counts.sum() / np.maximum(counts, 1) / num_classes
    return torch.tensor(w, dtype=torch.float32)


def evaluate_arrays(
    model: nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    rt: Runtime,
    d: Dist,
    criterion: nn.Module,
    ok_index: int,
    max_false_alarm_rate: float,
    groups: np.ndarray | None = None,
) -> dict:
    """Val loss and accuracy, plus the two figures the line cares about: ROC AUC of the defect score and
    the defect recall at the threshold that flags ``max_false_alarm_rate`` of the val OK images (each
    near-duplicate group counted once when ``groups`` is given, as the evaluate stage does)."""
    logits = predict_logits(model, images, rt, d)
    loss = criterion(torch.from_numpy(logits), torch.from_numpy(labels)).item()
    scores = 1.0 - softmax(logits)[:, ok_index]
    is_defect = labels != ok_index
    row = {"val_loss": loss, "val_acc": float((logits.argmax(1) == labels).mean())}
    row["val_auc"] = roc_auc(scores, is_defect)
    if is_defect.any() and not is_defect.all():
        w = None if groups is None else group_weights(groups, is_defect)[~is_defect]
        threshold = threshold_for_false_alarms(scores[~is_defect], max_false_alarm_rate, w)
        row["val_recall_at_far"] = binary_metrics(scores, is_defect, threshold)["defect_recall"]
    else:
        row["val_recall_at_far"] = float("nan")
    return row


def monitor_score(row: dict, monitor: str) -> list[float]:
    """Higher is better. val_recall_at_far moves in steps of one val defect, so val_auc breaks its ties;
    ``last`` ranks every epoch above the one before (the end of the cosine schedule is kept).
    NaN (a val split without defects or without OK images) ranks lowest."""
    key = {
        "val_loss": (-row["val_loss"], 0.0),
        "val_auc": (row["val_auc"], -row["val_loss"]),
        "last": (row["epoch"], 0.0),
    }.get(monitor, (row["val_recall_at_far"], row["val_auc"]))
    return [-math.inf if math.isnan(v) else float(v) for v in key]


def full_model_state(model: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (on rank 0; gathered from the shards under FSDP, collectively)."""
    if d.mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
    # the mask head (train.mask_loss) only teaches the features during training: evaluate, export and
    # the runner use the classifier alone, so the saved model is the plain network
    return {k: v for k, v in state.items() if not k.startswith("mask_head.")}


MODEL_META = ("architecture", "global_pool", "input_norm")  # what it takes to rebuild a member's network


def save_model(state: dict[str, torch.Tensor], meta: dict, path: Path, tiles: dict | None = None) -> None:
    """The consolidated model that evaluate and export read: weights plus what it takes to rebuild it;
    ``tiles``: the tile model's ``{"model": weights, "meta": ...}``, kept beside it."""
    ckpt = {"version": checkpoint.CHECKPOINT_VERSION, "model": state, "meta": meta}
    checkpoint.save_atomic(ckpt | ({"tiles": tiles} if tiles else {}), path)


def load_model(path: Path) -> tuple[DefectNet | Ensemble, dict]:
    """The consolidated model and its meta; everything needed to rebuild it is in the file itself."""
    from pipeline.config import ModelConfig

    ckpt = checkpoint.load(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: no readable trained model (run the train stage)")
    meta = ckpt["meta"]

    def build(spec: dict) -> DefectNet:
        cfg = ModelConfig(
            name=spec["architecture"],
            pretrained="false",
            drop_rate=0.0,
            global_pool=spec["global_pool"],
            input_norm=spec["input_norm"],
        )
        return create_model(cfg, len(meta["classes"]), meta["channels"])

    members = meta.get("members", 1)
    if members == 1 and "member_models" not in meta:
        net: nn.Module = build(meta)
    else:  # each member its own network (train.ensemble_members may change model.*); older files: all alike
        net = Ensemble([build(spec) for spec in meta.get("member_models", [meta] * members)])
    net.load_state_dict(ckpt["model"])
    return net.eval(), meta


def load_tile_model(path: Path) -> tuple[DefectNet, dict] | None:
    """The tile model packed beside the whole-image model in ``path`` (``train`` with tiles) and its meta
    (``weight``, ``tile``: the input side), or None where the model has no tiles."""
    from pipeline.config import ModelConfig

    ckpt = checkpoint.load(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: no readable trained model (run the train stage)")
    if "tiles" not in ckpt:
        return None
    meta = ckpt["tiles"]["meta"]
    cfg = ModelConfig(meta["architecture"], "false", 0.0, meta["global_pool"], meta["input_norm"])
    net = create_model(cfg, len(meta["classes"]), meta["channels"])
    net.load_state_dict(ckpt["tiles"]["model"])
    return net.eval(), meta


def rng_state(rt: Runtime) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if rt.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(rt.device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], rt: Runtime) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and rt.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], rt.device)


def local_buffers(model: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """This rank's own buffers (BatchNorm statistics) when ranks differ: until they are averaged at the
    end of an epoch, each rank's running statistics saw its own images, and a checkpoint of rank 0's
    alone would change the other ranks' on resume."""
    if not d.enabled:
        return {}
    names = ("running_mean", "running_var", "num_batches_tracked")
    return {n: b.detach().cpu().clone() for n, b in unwrap(model).named_buffers() if n.endswith(names)}


def set_local_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    own = dict(unwrap(model).named_buffers())
    with torch.no_grad():
        for n, t in buffers.items():
            own[n].copy_(t)


def build_model(
    params: Params,
    num_classes: int,
    channels: int,
    rt: Runtime,
    d: Dist,
    init: WarmStart | None = None,
    with_mask_head: bool = False,
) -> nn.Module:
    """The network on its device (warm-started where asked), channels_last, DDP/FSDP, compiled if asked."""
    cfg = params.train
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = create_model(params.model, num_classes, channels)
    if init is not None:
        init.load_into(model, params.model.name)
    if with_mask_head:
        model.add_mask_head()
    model = model.to(rt.device)
    channels_last = cfg.channels_last and d.mode != "fsdp"
    if cfg.channels_last and not channels_last:
        log.warning("train.channels_last is ignored with fsdp: fully_shard cannot shard non-contiguous weights")
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = distributed.wrap(model, d, rt.device)
    if cfg.compile:
        model.compile()
    log.info("model: %s, channels_last=%s, compile=%s, %s", params.model.name, channels_last, cfg.compile, d.mode)
    return model


def train(
    params: Params, prepared_dir: Path, out_dir: Path, reports_dir: Path, data_reports: Path | None = None
) -> dict | None:
    """Train (rank 0 returns the summary, other ranks None). ``data_reports``: the folder holding
    ``validate/`` and ``augment/`` reports, logged into the run so it shows what data it learned from."""
    cfg = params.train
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rt = resolve_runtime(cfg.device, cfg.precision)
    d = distributed.init(cfg.distributed, rt.device.type)
    if rt.device.type == "cuda" and d.enabled:
        rt.device = torch.device("cuda", d.local_rank)
    if not d.is_main:
        logging.getLogger().setLevel(logging.WARNING)
    try:
        if (prepared_dir / "tiles/prepare.json").is_file():  # the prepare stage cut tiles: a tile model too
            keep = params.tiles.keep_members
            return _train_ensemble(params, prepared_dir, out_dir, reports_dir, data_reports, rt, d, keep, True)
        if cfg.ensemble == 1:
            return _train(params, prepared_dir, out_dir, reports_dir, data_reports, rt, d)
        return _train_ensemble(params, prepared_dir, out_dir, reports_dir, data_reports, rt, d)
    finally:
        d.close()


def _train_ensemble(
    params: Params,
    prepared_dir: Path,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    rt: Runtime,
    d: Dist,
    keep: list[int] | None = None,
    with_tiles: bool = False,
) -> dict | None:
    """``train.ensemble`` members (those in ``keep``, default all) one after the other, each a whole training
    run of its own (seed ``train.seed + k``; checkpoints, model, curves and MLflow run under
    ``checkpoints/member-k``), so a killed run resumes inside the member it was in and finished members are
    not trained again. ``with_tiles``: then the tile model, the same way under ``checkpoints/tiles``, on
    ``prepared_dir/tiles`` (``tiles.recipe``). Then ``model.pt`` holds them all (an ``Ensemble``; the tile
    model beside it, read by ``load_tile_model``), and ``run.json`` names the ensemble's MLflow run, into
    which the later stages log as they do for a single model."""
    cfg = params.train
    ks = list(range(cfg.ensemble)) if keep is None else keep
    members = []
    for k in ks:
        member = member_params(params, k)
        where = out_dir / "checkpoints" / f"member-{k}"
        changes = cfg.ensemble_members[k] if cfg.ensemble_members else {}
        log.info(
            "ensemble member %d of %d (train.seed %d%s)",
            k + 1,
            cfg.ensemble,
            cfg.seed + k,
            "".join(f", {key} changed" for key in changes),
        )
        members.append((where, _train(member, prepared_dir, where, where / "reports", data_reports, rt, d)))
    tiles = None
    if with_tiles:
        where = out_dir / "checkpoints" / "tiles"
        log.info("the tile model (tiles.recipe: %s)", ", ".join(f"{k} {v}" for k, v in params.tiles.recipe.items()))
        tiles = (where, _train(tile_params(params), prepared_dir / "tiles", where, where / "reports", data_reports,
                               rt, d))  # fmt: skip
    if not d.is_main:
        return None
    states, metas = [], []
    for where, _ in members:
        ckpt = checkpoint.load(where / "model.pt")
        if ckpt is None:
            raise FileNotFoundError(f"{where / 'model.pt'}: an ensemble member's model is unreadable; delete {where}")
        states.append(ckpt["model"])
        metas.append(ckpt["meta"])
    packed_tiles = None
    if tiles:
        ckpt = checkpoint.load(tiles[0] / "model.pt")
        if ckpt is None:
            raise FileNotFoundError(f"{tiles[0] / 'model.pt'}: the tile model is unreadable; delete {tiles[0]}")
        tile_info = read_summary(prepared_dir / "tiles")
        packed_tiles = {"model": ckpt["model"], "meta": {**ckpt["meta"], "weight": params.tiles.weight,
                                                        "tile": tile_info["image_size"]}}  # fmt: skip
    fp = hashlib.sha256("".join(m["fingerprint"] for m in metas).encode())
    if packed_tiles:
        fp.update(f"tiles {packed_tiles['meta']['fingerprint']} {params.tiles.weight}".encode())
    fp = fp.hexdigest()
    models = [{key: m[key] for key in MODEL_META} for m in metas]
    names = [m["architecture"] for m in metas]
    meta = {
        **metas[0],
        # one name when every member is the same network; else each member's, in order (the model card's)
        "architecture": names[0] if len(set(names)) == 1 else " + ".join(names),
        "member_models": models,
        "fingerprint": fp,
        "members": len(metas),
        "member_seeds": [cfg.seed + k for k in ks],
        "member_changes": [cfg.ensemble_members[k] for k in ks] if cfg.ensemble_members else [],
        "member_epochs": [m["epoch"] for m in metas],
    }
    state = {f"members.{k}.{name}": v for k, s in enumerate(states) for name, v in s.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(state, meta, out_dir / "model.pt", packed_tiles)
    net, _ = load_model(out_dir / "model.pt")
    net = net.to(rt.device)  # load_model builds on the CPU; the val arrays go to rt.device (a GPU: found on an H200)
    info = read_summary(prepared_dir)
    x_va, y_va, _ = load_split(prepared_dir, "val")
    ok_index = info["classes"].index(info["ok_class"])
    far, groups = params.evaluate.max_false_alarm_rate, load_groups(prepared_dir, "val")
    val = evaluate_arrays(net, x_va, y_va, rt, Dist("none"), nn.CrossEntropyLoss(), ok_index, far, groups)
    reports_dir.mkdir(parents=True, exist_ok=True)
    # history.csv is member 0's (one row per epoch, as DVC plots expects); the PNGs show every member,
    # and the ensemble's own val figures beside theirs.
    shutil.copyfile(members[0][0] / "reports/history.csv", reports_dir / "history.csv")
    histories = [read_history(where / "reports/history.csv") for where, _ in members]
    for keys, title, name in CURVES:
        members_curves_plot(histories, keys, title, reports_dir / name, final=val)
    summary = {
        "ensemble": len(metas),
        **{k: float(v) for k, v in val.items()},
        "steps": sum(s["steps"] for _, s in members),
        "train_images": members[0][1]["train_images"],
        "train_img_s": float(np.median([s["train_img_s"] for _, s in members])),
        "device": str(rt.device),
        "precision": rt.precision,
        "members": [s for _, s in members],
    }
    if tiles:  # the tile model's own val figures are by tile; the fused ones come from the evaluate stage
        from pipeline.tiles import fit_check

        with np.load(prepared_dir / "tiles/train.npz") as z:
            labels = z["labels"]
        tp = tile_params(params)
        fit = fit_check(tiles[0] / "reports/history.csv", labels, ok_index, tp.train.majority_per_epoch)
        summary["tiles"] = {**tiles[1], **fit, "architecture": tp.model.name}
        summary |= {"tiles_train_img_s": float(tiles[1]["train_img_s"]), "tiles_val_auc": float(fit["tile_val_auc"]),
                    "tiles_model_fit": int(fit["tile_model_fit"])}  # fmt: skip
    (reports_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    run_ids = [json.loads((where / "run.json").read_text())["run_id"] for where, _ in members]
    known = out_dir / "checkpoints" / "ensemble-run.json"  # the same members again: the same run
    previous = json.loads(known.read_text()) if known.is_file() else {}
    tags = {f"member_{k}.run_id": r for k, r in zip(ks, run_ids, strict=True)}
    if tiles:
        tags["tiles.run_id"] = json.loads((tiles[0] / "run.json").read_text())["run_id"]
    run_id = previous.get("run_id") if previous.get("fingerprint") == fp else None
    label = f"{info['image_size']}px-ensemble{len(metas)}" + ("+tiles" if tiles else "")
    with open_train_run(params, run_id, label, fp, tags, data_reports) as run:
        run.log_metrics({k: v for k, v in summary.items() if isinstance(v, float | int)})
        run.log_artifacts(reports_dir, "train")
        run.log_artifacts(out_dir / "model.pt", "model")
        run_file = {"run_id": run.run_id, "fingerprint": fp}
    known.write_text(json.dumps(run_file) + "\n")
    (out_dir / "run.json").write_text(json.dumps(run_file) + "\n")
    log.info(
        "ensemble of %d: val AUC %.3f, val recall at %.0f%% false alarms %.3f",
        len(metas),
        val["val_auc"],
        100 * params.evaluate.max_false_alarm_rate,
        val["val_recall_at_far"],
    )
    return summary


def _train(
    params: Params,
    prepared_dir: Path,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    rt: Runtime,
    d: Dist,
) -> dict | None:
    cfg = params.train
    info = read_summary(prepared_dir)
    classes, channels = info["classes"], info["channels"]
    x_tr, y_tr = load_train_split(prepared_dir)
    x_va, y_va, _ = load_split(prepared_dir, "val")
    g_va = load_groups(prepared_dir, "val")
    m_tr = train_masks(prepared_dir, len(y_tr)) if cfg.mask_loss > 0 else None
    sampler = EpochBatches(
        y_tr, cfg.batch_size, cfg.seed, d.rank, d.world_size, cfg.class_weighting == "sampling", cfg.majority_per_epoch
    )
    # the same decision as the augment stage's (reports/augment/orientation.json), also for a member's own
    # policy: measured on the prepared training images, which come before the balancing copies in x_tr
    prepared_train = x_tr[: sum(info["splits"]["train"].values())]
    policy, pose = resolve_policy(params.augment.policy, params.augment.orientation, prepared_train)
    loader = DataLoader(
        ImageDataset(x_tr, y_tr, build_policy(policy), masks=m_tr),
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=rt.device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
        generator=torch.Generator(),  # its own seed source: iter(loader) must not consume the dropout RNG
    )
    steps = len(sampler)

    init = resolve_init(params)
    model = build_model(params, len(classes), channels, rt, d, init, with_mask_head=m_tr is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_epochs * steps, cfg.epochs * steps)
    )
    ema = EMA(model, cfg.ema)
    weight = class_weights(y_tr, len(classes)).to(rt.device) if cfg.class_weighting == "loss" else None
    ok_index, far = classes.index(info["ok_class"]), params.evaluate.max_false_alarm_rate
    if cfg.focal_gamma > 0:
        ce = FocalLoss(cfg.focal_gamma, weight, cfg.label_smoothing)
    else:
        ce = nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)
    criterion = RankingLoss(ok_index, cfg.ranking_loss, ce)
    mask_criterion = MaskLoss(cfg.mask_loss) if m_tr is not None else None
    eval_criterion = nn.CrossEntropyLoss()
    torch.manual_seed(cfg.seed * 7919 + d.rank)  # this rank's dropout stream from here on

    fp = fingerprint(params, prepared_dir, init.identity if init else "")
    store = checkpoint.CheckpointDir(out_dir / "checkpoints", d, cfg.keep_last)
    state: dict[str, Any] = {
        "epoch": 0,  # epochs completed
        "global_step": 0,
        "best": None,  # best monitor_score so far (higher is better)
        "bad_epochs": 0,  # epochs since it improved (early stopping)
        "stopped_early": False,
        "best_models": [],  # [[monitor score, file name], ...] consolidated best models kept, best first
        "history": [],
        "run_id": None,
    }
    progress = EpochProgress()
    resumed = resume(store, fp, model, optimizer, ema, d, cfg.on_mismatch)
    if resumed is not None:
        saved, where = resumed
        scheduler.load_state_dict(saved["scheduler"])
        rt.scaler.load_state_dict(saved["scaler"])
        mine = saved["ranks"][d.rank] if d.rank < len(saved["ranks"]) else saved["ranks"][0]
        set_rng_state(mine["rng"], rt)
        set_local_buffers(model, mine["buffers"])
        progress = EpochProgress(**mine["progress"])
        state = {k: saved[k] for k in state}
        log.info(
            "resuming from %s after epoch %d, step %d (%d steps done)",
            where,
            state["epoch"],
            progress.step,
            state["global_step"],
        )

    def save_checkpoint(progress: EpochProgress) -> None:
        ranks = d.all_gather_object(
            {"rng": rng_state(rt), "progress": progress.as_dict(), "buffers": local_buffers(model, d)}
        )
        body = {
            "scheduler": scheduler.state_dict(),
            "scaler": rt.scaler.state_dict(),
            "fingerprint": fp,
            "world_size": d.world_size,
            "ranks": ranks,
            **state,
        }
        if d.mode == "fsdp":
            body["ema_updates"] = ema.updates  # the EMA weights themselves are among the shards
            store.save(state["global_step"], body, sharded_state(model, optimizer, ema))
        else:
            body |= {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "ema": ema.state_dict()}
            store.save(state["global_step"], body)

    meta = {
        "architecture": params.model.name,
        "global_pool": params.model.global_pool,
        "input_norm": params.model.input_norm,
        "classes": classes,
        "ok_class": info["ok_class"],
        "channels": channels,
        "image_size": info["image_size"],
        "resize": info["resize"],
        "fingerprint": fp,
        "ema": cfg.ema,
        "init_from": init.identity if init else "",
    }
    tags = {"init_from": init.identity, "init_from.run_id": init.run_id} if init is not None else {}
    tags["augment.flips_and_turns"] = pose["flips_and_turns"]  # augment.orientation's decision (auto: the images')
    label = f"{info['image_size']}px"
    run_ctx = open_train_run(params, state["run_id"], label, fp, tags, data_reports) if d.is_main else None
    with run_ctx or contextlib.nullcontext() as run:
        if d.is_main:
            state["run_id"] = run.run_id
        log.info(
            "training %s on %d images (%s, %s, %d process%s) for %d epochs of %d steps; MLflow run %s",
            params.model.name,
            len(y_tr),
            rt.device,
            rt.precision,
            d.world_size,
            "es" if d.world_size > 1 else "",
            cfg.epochs,
            steps,
            state["run_id"],
        )
        every = cfg.checkpoint_every_steps
        while state["epoch"] < cfg.epochs and not state["stopped_early"]:
            epoch = state["epoch"]
            sampler.set_epoch(epoch, progress.step)
            start_step = state["global_step"] - progress.step

            def due(p: EpochProgress, start_step=start_step) -> bool:
                return every > 0 and p.step < steps and (start_step + p.step) % every == 0

            def mid_epoch_checkpoint(p: EpochProgress, start_step=start_step) -> None:
                state["global_step"] = start_step + p.step
                save_checkpoint(p)

            row = {"epoch": epoch + 1} | train_one_epoch(
                model,
                loader,
                criterion,
                optimizer,
                scheduler,
                rt,
                ema,
                progress,
                d,
                grad_clip=cfg.grad_clip,
                desc=f"epoch {epoch + 1}/{cfg.epochs}",
                checkpoint_due=due,
                checkpoint=mid_epoch_checkpoint,
                mask_criterion=mask_criterion,
            )
            distributed.average_batchnorm_stats(model, d)
            with ema.applied(model):  # validate (and keep) the averaged weights when EMA is on
                row |= evaluate_arrays(model, x_va, y_va, rt, d, eval_criterion, ok_index, far, g_va)
                score = monitor_score(row, cfg.monitor)
                improved = state["best"] is None or score > state["best"]
                weights = full_model_state(model, d) if improved else None
            state["history"].append(row)
            state["epoch"], state["global_step"] = epoch + 1, start_step + steps
            if improved:
                state["best"], state["bad_epochs"] = score, 0
                if d.is_main:
                    watched = row.get(cfg.monitor, epoch + 1)  # monitor "last": the epoch itself
                    best_meta = {**meta, "epoch": epoch + 1, "val_loss": row["val_loss"], cfg.monitor: watched}
                    keep_best_model(weights, best_meta, score, state, cfg, store)
            else:
                state["bad_epochs"] += 1
            if cfg.early_stopping_patience and state["bad_epochs"] >= cfg.early_stopping_patience:
                state["stopped_early"] = True
                log.info("early stop: %s has not improved for %d epochs", cfg.monitor, state["bad_epochs"])
            if d.is_main:
                run.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch + 1)
                log.info("epoch %d: %s", epoch + 1, ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch"))
            progress = EpochProgress()
            save_checkpoint(progress)
        if not d.is_main:
            return None
        return finish(run, state, cfg, store.root, out_dir, reports_dir, rt, steps, len(y_tr), sampler.n)


@contextlib.contextmanager
def open_train_run(
    params: Params, run_id: str | None, label: str, fp: str, tags: dict, data_reports: Path | None
) -> Iterator[tracking.Run]:
    """The train stage's MLflow run, continued when ``run_id`` still exists: named
    ``<model>-<label>-<fingerprint>`` (after the experiment's name under ``dvc exp run``, so runs tell
    apart); a new run (also when the old one is gone) records what it was made from."""
    name = f"{params.model.name}-{label}-{fp[:8]}"
    if os.environ.get("DVC_EXP_NAME"):
        name = f"{os.environ['DVC_EXP_NAME']}-{name}"
    tags = {**tracking.git_info(), **tracking.lineage_tags(), "data.fingerprint": fp, "stage": "train", **tags}
    with tracking.open_run(params.mlflow, run_id, name, tags) as run:
        if run.new:
            run.log_params({k: v for k, v in as_flat_dict(params).items() if k != "source_file"})
            log_data_reports(run, data_reports)
        yield run


def log_data_reports(run: tracking.Run, folder: Path | None) -> None:
    """The validation figures as ``data_*`` metrics and the data reports as artifacts of the run."""
    if folder is None:
        return
    summary = folder / "validate" / "summary.json"
    if summary.is_file():
        figures = json.loads(summary.read_text())
        run.log_metrics({f"data_{k}": v for k, v in figures.items() if isinstance(v, int | float)})
        run.log_metrics({f"data_count_{c}": n for c, n in figures.get("per_class", {}).items()})
    for sub in ("validate", "augment"):
        if (folder / sub).is_dir():
            run.log_artifacts(folder / sub, sub)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA) -> dict[str, Any]:
    """FSDP: the model and optimizer state dicts as shards (DTensors) plus the EMA shards, for DCP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "ema": ema.shadow}


def resume(
    store: checkpoint.CheckpointDir,
    fp: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: EMA,
    d: Dist,
    on_mismatch: str,
) -> tuple[dict, Path] | None:
    """Load model, optimizer and EMA from the newest good checkpoint; return its state and folder.

    A checkpoint made from other params or data is not resumed silently: with ``on_mismatch: stop``
    the stage stops; with ``restart`` it says so, moves the old checkpoints to ``superseded/`` and
    starts fresh.
    """
    store.clean_unfinished()
    steps = store.steps()
    if not steps:
        return None
    newest = checkpoint.load(steps[0] / "state.pt")
    if newest is not None and newest["fingerprint"] != fp:
        old_fp = newest["fingerprint"][:12]
        where = (
            f"{steps[0]} was trained on other params, code, data or warm start (fingerprint {old_fp}, now {fp[:12]})"
        )
        if on_mismatch == "stop":
            raise ConfigError(f"checkpoint {where}; stopping (train.on_mismatch: stop). Move it away to start fresh")
        log.warning("checkpoint %s: starting fresh; the old checkpoints move to %s", where, store.root / "superseded")
        if d.is_main:
            old = store.root / "superseded"
            shutil.rmtree(old, ignore_errors=True)
            old.mkdir()
            for p in list(store.root.iterdir()):
                if p != old:
                    p.rename(old / p.name)
        d.barrier()
        return None
    if d.mode == "fsdp":
        template = sharded_state(model, optimizer, ema)
        found = store.load_latest(template, newest)
        if found is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optimizer"])
            ema.updates = found[0]["ema_updates"]
    else:
        found = store.load_latest(newest=newest)
        if found is not None:
            saved = found[0]
            unwrap(model).load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            ema.load_state_dict(saved["ema"])
    if found is None:
        log.warning("no usable checkpoint in %s: starting fresh", store.root)
    return found


def keep_best_model(
    weights: dict, meta: dict, score: list[float], state: dict, cfg: Any, store: checkpoint.CheckpointDir
) -> None:
    """Write the consolidated model of this epoch and keep only the ``keep_best`` best-scoring ones."""
    name = f"best-epoch{meta['epoch']:03d}.pt"
    save_model(weights, meta, store.root / name)
    ranked = sorted([*(b for b in state["best_models"] if b[1] != name), [score, name]], reverse=True)
    for _, dropped in ranked[cfg.keep_best :]:
        (store.root / dropped).unlink(missing_ok=True)
    state["best_models"] = ranked[: cfg.keep_best]


def finish(
    run: tracking.Run,
    state: dict,
    cfg: Any,
    ckpt_root: Path,
    out_dir: Path,
    reports_dir: Path,
    rt: Runtime,
    steps: int,
    n_train: int,
    epoch_images: int,
) -> dict:
    """Rank 0, after the last epoch: the best model to model.pt, run.json, history, curves, metrics."""
    best_file = ckpt_root / state["best_models"][0][1]
    best = checkpoint.load(best_file)
    if best is None:
        raise FileNotFoundError(f"{best_file}: the best model file is unreadable; delete {ckpt_root} and retrain")
    shutil.copyfile(best_file, out_dir / "model.pt")
    run_file = {"run_id": state["run_id"], "fingerprint": best["meta"]["fingerprint"]}
    (out_dir / "run.json").write_text(json.dumps(run_file) + "\n")
    reports_dir.mkdir(parents=True, exist_ok=True)
    with open(reports_dir / "history.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(state["history"][0]))
        w.writeheader()
        w.writerows(state["history"])
    for keys, title, name in CURVES:
        curves_plot(state["history"], keys, title, reports_dir / name)
    summary = {
        "best_epoch": best["meta"]["epoch"],
        "best_val_loss": best["meta"]["val_loss"],
        "monitor": cfg.monitor,
        f"best_{cfg.monitor}": best["meta"][cfg.monitor],
        "epochs_run": state["epoch"],
        "stopped_early": state["stopped_early"],
        "steps": state["global_step"],
        "train_images": n_train,
        "epoch_images": epoch_images,  # fewer than train_images with train.majority_per_epoch < 1
        "train_img_s": float(np.median([r["train_img_s"] for r in state["history"]])),
        "device": str(rt.device),
        "precision": rt.precision,
    }
    (reports_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    run.log_artifacts(reports_dir, "train")
    run.log_artifacts(out_dir / "model.pt", "model")  # what `train.init_from: champion` starts from
    return summary
