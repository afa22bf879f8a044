"""Fitting one model: a timm network on one prepared folder; checkpointed, resumable, single or multi-process.

``fit()`` reads as the recipe of one training run: load the data (``TrainData``), build the model,
optimizer, schedule and loss, resume from the newest good checkpoint (``Checkpointer``), then run
epochs (``Fit.epoch``), each validated and checkpointed. The step loop itself is
``pipeline.training.loop.train_one_epoch``; which models a stage trains (ensemble members, the tile
model) is ``pipeline.training.recipe``. Only rank 0 logs, writes files and talks to MLflow.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader

from pipeline import checkpoint, distributed, tracking
from pipeline.config import Params, as_flat_dict
from pipeline.data.augment import ImageDataset, build_policy, resolve_policy
from pipeline.data.masks import MASK_UNKNOWN
from pipeline.data.prepare import load_groups, load_masks, load_split, ok_index, read_summary
from pipeline.distributed import Dist, unwrap
from pipeline.metrics import binary_metrics, group_weights, roc_auc, softmax, threshold_for_false_alarms
from pipeline.model import create_model, predict_logits
from pipeline.plots import curves_plot
from pipeline.runtime import Runtime
from pipeline.seeds import DROPOUT, derive_seed
from pipeline.training.loop import EMA, EpochBatches, EpochProgress, FocalLoss, MaskLoss, RankingLoss, train_one_epoch
from pipeline.training.state import Checkpointer
from pipeline.training.warmstart import WarmStart, resolve_init

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


REPO = Path(__file__).resolve().parents[2]


def code_files(stage: str = "train", dvc_yaml: Path = REPO / "dvc.yaml") -> list[Path]:
    """The Python files under the code deps of ``stage`` in ``dvc.yaml``: the same list DVC watches, so a
    change that reruns the stage also changes the fingerprint (a finished checkpoint of other code is then
    not handed back). Without a dvc.yaml (an installed package), every file of ``pipeline/``."""
    if not dvc_yaml.is_file():
        return sorted((REPO / "pipeline").rglob("*.py"))
    deps = yaml.safe_load(dvc_yaml.read_text())["stages"][stage]["deps"]
    files: set[Path] = set()
    for dep in deps:
        path = dvc_yaml.parent / dep
        if path.is_file() and path.suffix == ".py":
            files.add(path)
        elif path.is_dir() and dep.split("/")[0] not in ("data", "models", "reports"):
            files.update(path.rglob("*.py"))
    return sorted(files)


def training_fingerprint(params: Params, prepared_dir: Path, init: str = "") -> str:
    """sha256 over the params and code that shape the weights (``code_files``), the bytes of the training
    data and the identity of the warm-start weights (``init``)."""
    h = hashlib.sha256(init.encode())
    for path in code_files():
        h.update(path.read_bytes())
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
    ok_index: int | None,
    max_false_alarm_rate: float,
    groups: np.ndarray | None = None,
) -> dict:
    """Val loss and accuracy, plus the two figures the line cares about: ROC AUC of the defect score and
    the defect recall at the threshold that flags ``max_false_alarm_rate`` of the val OK images (each
    near-duplicate group counted once when ``groups`` is given, as the evaluate stage does). Without an
    OK class (``ok_index`` None: defect-type sorting) those two are NaN."""
    logits = predict_logits(model, images, rt, d)
    loss = criterion(torch.from_numpy(logits), torch.from_numpy(labels)).item()
    if ok_index is None:
        nan = float("nan")
        return {
            "val_loss": loss,
            "val_acc": float((logits.argmax(1) == labels).mean()),
            "val_auc": nan,
            "val_recall_at_far": nan,
        }
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
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
    # the mask head (train.mask_loss) only teaches the features during training: evaluate, export and
    # the runner use the classifier alone, so the saved model is the plain network
    return {k: v for k, v in state.items() if not k.startswith("mask_head.")}


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


@dataclass
class TrainData:
    """One prepared folder, loaded for training: the train split (plus the augment stage's balancing copies)
    behind its sampler and loader, the val split, and the augmentation pose decision."""

    info: dict  # prepare.json: classes, ok_class, channels, image_size, resize, splits
    x_tr: np.ndarray  # (N, H, W, C) uint8
    y_tr: np.ndarray  # (N,) int64
    x_va: np.ndarray
    y_va: np.ndarray
    g_va: np.ndarray  # the val images' near-duplicate groups
    masks: np.ndarray | None  # (N, H, W) uint8 for train.mask_loss, else None
    sampler: EpochBatches
    loader: DataLoader
    pose: dict  # augment.orientation's decision on these images

    @classmethod
    def load(cls, params: Params, prepared_dir: Path, rt: Runtime, d: Dist) -> TrainData:
        cfg = params.train
        info = read_summary(prepared_dir)
        x_tr, y_tr = load_train_split(prepared_dir)
        x_va, y_va, _ = load_split(prepared_dir, "val")
        g_va = load_groups(prepared_dir, "val")
        m_tr = train_masks(prepared_dir, len(y_tr)) if cfg.mask_loss > 0 else None
        balanced = cfg.class_weighting == "sampling"
        sampler = EpochBatches(y_tr, cfg.batch_size, cfg.seed, d.rank, d.world_size, balanced, cfg.majority_per_epoch)
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
        return cls(info, x_tr, y_tr, x_va, y_va, g_va, m_tr, sampler, loader, pose)

    @property
    def classes(self) -> list[str]:
        return self.info["classes"]

    @property
    def ok_index(self) -> int | None:
        return ok_index(self.info)

    @property
    def steps(self) -> int:
        return len(self.sampler)


def objective(params: Params, data: TrainData, rt: Runtime) -> tuple[nn.Module, MaskLoss | None]:
    """The training loss (cross-entropy or focal, class-weighted or not, plus the ranking term) and the mask
    head's loss where ``train.mask_loss`` has masks to learn from."""
    cfg = params.train
    weight = class_weights(data.y_tr, len(data.classes)).to(rt.device) if cfg.class_weighting == "loss" else None
    if cfg.focal_gamma > 0:
        ce = FocalLoss(cfg.focal_gamma, weight, cfg.label_smoothing)
    else:
        ce = nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)
    return RankingLoss(data.ok_index, cfg.ranking_loss, ce), MaskLoss(cfg.mask_loss) if data.masks is not None else None


@dataclass
class Fit:
    """The live parts of one training run; ``epoch()`` trains, validates and checkpoints one epoch."""

    params: Params
    data: TrainData
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMA
    criterion: nn.Module
    mask_criterion: MaskLoss | None
    ckpt: Checkpointer
    meta: dict  # what the consolidated model file records beside the weights
    rt: Runtime
    d: Dist
    on_epoch: Callable[[tracking.Run, dict], None] | None = None  # RunSpec.on_epoch

    def epoch(self, progress: EpochProgress, run: tracking.Run | None) -> None:
        cfg, state, d, steps = self.params.train, self.ckpt.state, self.d, self.data.steps
        epoch = state["epoch"]
        self.data.sampler.set_epoch(epoch, progress.step)
        start_step = state["global_step"] - progress.step
        every = cfg.checkpoint_every_steps

        def due(p: EpochProgress) -> bool:
            return every > 0 and p.step < steps and (start_step + p.step) % every == 0

        def mid_epoch_checkpoint(p: EpochProgress) -> None:
            state["global_step"] = start_step + p.step
            self.ckpt.save(p)

        row = {"epoch": epoch + 1} | train_one_epoch(
            self.model,
            self.data.loader,
            self.criterion,
            self.optimizer,
            self.scheduler,
            self.rt,
            self.ema,
            progress,
            d,
            grad_clip=cfg.grad_clip,
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            checkpoint_due=due,
            checkpoint=mid_epoch_checkpoint,
            mask_criterion=self.mask_criterion,
        )
        distributed.average_batchnorm_stats(self.model, d)
        improved, weights, score = self.validate(row)
        state["history"].append(row)
        state["epoch"], state["global_step"] = epoch + 1, start_step + steps
        if improved:
            state["best"], state["bad_epochs"] = score, 0
            if d.is_main:
                watched = row.get(cfg.monitor, epoch + 1)  # monitor "last": the epoch itself
                best_meta = {**self.meta, "epoch": epoch + 1, "val_loss": row["val_loss"], cfg.monitor: watched}
                self.ckpt.keep_best(weights, best_meta, score)
        else:
            state["bad_epochs"] += 1
        if cfg.early_stopping_patience and state["bad_epochs"] >= cfg.early_stopping_patience:
            state["stopped_early"] = True
            log.info("early stop: %s has not improved for %d epochs", cfg.monitor, state["bad_epochs"])
        if d.is_main:
            run.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch + 1)
            log.info("epoch %d: %s", epoch + 1, ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch"))
            if self.on_epoch is not None:
                self.on_epoch(run, row)
        self.ckpt.save(EpochProgress())

    def validate(self, row: dict) -> tuple[bool, dict | None, list[float]]:
        """Add the val figures to ``row``; whether the monitored score improved, and then the weights (all
        ranks take part: FSDP gathers them collectively)."""
        data, far = self.data, self.params.evaluate.max_false_alarm_rate
        with self.ema.applied(self.model):  # validate (and keep) the averaged weights when EMA is on
            row |= evaluate_arrays(
                self.model, data.x_va, data.y_va, self.rt, self.d, nn.CrossEntropyLoss(), data.ok_index, far, data.g_va
            )
            score = monitor_score(row, self.params.train.monitor)
            best = self.ckpt.state["best"]
            improved = best is None or score > best
            weights = full_model_state(self.model, self.d) if improved else None
        return improved, weights, score


def fit(
    params: Params,
    prepared_dir: Path,
    out_dir: Path,
    reports_dir: Path,
    data_reports: Path | None,
    rt: Runtime,
    d: Dist,
    spec: RunSpec | None = None,
) -> dict | None:
    """Train one model on ``prepared_dir`` into ``out_dir`` (model.pt, run.json, checkpoints/) and
    ``reports_dir`` (history, curves, metrics); rank 0 returns the summary, other ranks None.
    ``data_reports``: the folder holding ``validate/`` and ``augment/`` reports, logged into the model's run.
    ``spec``: the MLflow run's name and place (default: the model's own run, named by ``tracking.run_name``)."""
    cfg = params.train
    data = TrainData.load(params, prepared_dir, rt, d)
    init = resolve_init(params)
    model = build_model(params, len(data.classes), data.info["channels"], rt, d, init, data.masks is not None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = warmup_cosine(cfg.warmup_epochs * data.steps, cfg.epochs * data.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    ema = EMA(model, cfg.ema)
    criterion, mask_criterion = objective(params, data, rt)
    torch.manual_seed(derive_seed(cfg.seed, DROPOUT, d.rank))  # this rank's dropout stream from here on

    fingerprint = training_fingerprint(params, prepared_dir, init.identity if init else "")
    ckpt = Checkpointer(
        out_dir / "checkpoints", fingerprint, model, optimizer, scheduler, ema, rt, d, cfg.keep_last, cfg.keep_best
    )
    progress = ckpt.resume(cfg.on_mismatch)
    meta = model_meta(params, data.info, fingerprint, init)
    spec = spec or RunSpec(tracking.run_name(params.model.name, data.info["image_size"], fingerprint))
    job = Fit(
        params, data, model, optimizer, scheduler, ema, criterion, mask_criterion, ckpt, meta, rt, d, spec.on_epoch
    )
    tags = {"init_from": init.identity, "init_from.run_id": init.run_id} if init is not None else {}
    tags["augment.flips_and_turns"] = data.pose["flips_and_turns"]  # augment.orientation's decision
    state = ckpt.state
    run_ctx = open_train_run(params, state["run_id"], spec, fingerprint, tags, data_reports) if d.is_main else None
    with run_ctx or contextlib.nullcontext() as run:
        if d.is_main:
            state["run_id"] = run.run_id
        log.info(
            "training %s on %d images (%s, %s, %d process%s) for %d epochs of %d steps; MLflow run %s",
            params.model.name,
            len(data.y_tr),
            rt.device,
            rt.precision,
            d.world_size,
            "es" if d.world_size > 1 else "",
            cfg.epochs,
            data.steps,
            state["run_id"],
        )
        while state["epoch"] < cfg.epochs and not state["stopped_early"]:
            job.epoch(progress, run)
            progress = EpochProgress()
        if not d.is_main:
            return None
        return finish(run, ckpt, cfg, out_dir, reports_dir, rt, len(data.y_tr), data.sampler.n, not spec.parent_id)


def model_meta(params: Params, info: dict, fingerprint: str, init: WarmStart | None) -> dict:
    """What the consolidated model file records beside the weights: enough to rebuild and use it."""
    return {
        "architecture": params.model.name,
        "global_pool": params.model.global_pool,
        "input_norm": params.model.input_norm,
        "classes": info["classes"],
        "ok_class": info["ok_class"],
        "channels": info["channels"],
        "image_size": info["image_size"],
        "resize": info["resize"],
        "fingerprint": fingerprint,
        "ema": params.train.ema,
        "init_from": init.identity if init else "",
    }


@dataclass(frozen=True)
class RunSpec:
    """Where ``fit`` logs in MLflow: its run's name; the model's run it nests under (``parent_id``; empty: the
    run is the model's own, as for a single network); tags for it; and what rank 0 calls after each epoch's
    figures are logged, with the run and the epoch's row (``pipeline.training.recipe``: the expected time)."""

    name: str
    parent_id: str = ""
    tags: dict = field(default_factory=dict)
    on_epoch: Callable[[tracking.Run, dict], None] | None = None


def flat_params(params: Params) -> dict[str, Any]:
    return {k: v for k, v in as_flat_dict(params).items() if k != "source_file"}


@contextlib.contextmanager
def open_train_run(
    params: Params, run_id: str | None, spec: RunSpec, fingerprint: str, tags: dict, data_reports: Path | None
) -> Iterator[tracking.Run]:
    """``fit``'s MLflow run, continued when ``run_id`` still exists. A child run (an ensemble member, the
    tile model) records its own params beside its curves; the model's own run is ``open_model_run``'s.
    Continuing a child under another model's run moves it there (its finished network is reused)."""
    tags = {"train.fingerprint": fingerprint, "stage": "train", **spec.tags, **tags}
    if not spec.parent_id:
        with open_model_run(params, run_id, spec.name, tags, data_reports) as run:
            yield run
        return
    with tracking.open_run(params.mlflow, run_id, spec.name, {**tags, "mlflow.parentRunId": spec.parent_id}) as run:
        if run.new:
            run.log_params(flat_params(params))
        yield run


@contextlib.contextmanager
def open_model_run(
    params: Params, run_id: str | None, name: str, tags: dict, data_reports: Path | None
) -> Iterator[tracking.Run]:
    """The model's MLflow run, continued when ``run_id`` still exists: what it was made from (git, dvc.lock,
    params.yaml: ``tracking.git_info``, ``tracking.lineage_tags``) as tags; a new run also every param and
    the data reports."""
    tags = {**tracking.git_info(), **tracking.lineage_tags(), "stage": "train", **tags}
    with tracking.open_run(params.mlflow, run_id, name, tags) as run:
        if run.new:
            run.log_params(flat_params(params))
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


def finish(
    run: tracking.Run,
    ckpt: Checkpointer,
    cfg: Any,
    out_dir: Path,
    reports_dir: Path,
    rt: Runtime,
    n_train: int,
    epoch_images: int,
    log_model: bool = True,
) -> dict:
    """Rank 0, after the last epoch: the best model to model.pt, run.json, history, curves, metrics. The model
    file goes into the model's own run only (``log_model``): a child's network is in its model's file."""
    state, best_file = ckpt.state, ckpt.best_model()
    best = checkpoint.load(best_file)
    if best is None:
        raise FileNotFoundError(f"{best_file}: the best model file is unreadable; delete {ckpt.root} and retrain")
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
    if log_model:
        run.log_artifacts(out_dir / "model.pt", "model")  # what `train.init_from: champion` starts from
    return summary
