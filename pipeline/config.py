"""Typed, frozen views of ``params.yaml``.

Every section of ``params.yaml`` maps one-to-one onto a frozen dataclass below. ``load_params`` is
strict: a missing key, an unknown key or a value of the wrong type stops with a ``ConfigError``
that names the key (``train.lr: expected float, got 'fast'``), so a typo never silently falls back
to a default. Library code takes these objects, never a raw dict.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A problem in params.yaml; the message names the key."""


class StageError(RuntimeError):
    """A stage's own check failed (a data gate, the export parity): the message says which figure and
    why; the stage exits 2 with that line, no traceback. Defined here, beside ConfigError, so every
    stage can catch it without importing the heavy module that raises it."""


@dataclass(frozen=True)
class SyntheticConfig:
    counts: dict[str, int]  # images per class; "ok" plus any of scratch, spot, crack
    image_size: int  # side of the square images the generator writes


@dataclass(frozen=True)
class DataConfig:
    source: str  # "synthetic" or a folder with one subfolder per class
    ok_class: str  # the class that means "no defect"
    channels: Literal[1, 3]  # channels the model sees; images are converted to this
    seed: int
    synthetic: SyntheticConfig


@dataclass(frozen=True)
class ValidateConfig:
    min_side: int  # smaller images are quarantined
    max_pixels: int  # larger images are refused before decoding (decompression bombs)
    min_per_class: int  # the gate fails if an accepted class has fewer images
    max_bad_fraction: float  # the gate fails if a larger share of files is quarantined
    max_label_conflicts: int  # the gate fails if more files show the same content under two labels
    near_duplicate_bits: int  # perceptual hashes (256 bits) this close are one near-duplicate group


@dataclass(frozen=True)
class SplitConfig:
    val: float
    test: float


@dataclass(frozen=True)
class PrepareConfig:
    image_size: int  # model input side, pixels
    resize: Literal["letterbox", "squash"]
    split: SplitConfig


@dataclass(frozen=True)
class AugmentConfig:
    policy: list[dict[str, Any]]  # albumentations transforms: [{name: HorizontalFlip, p: 0.5}, ...]
    preview_per_class: int
    balance: float  # raise each class to this share of the largest in train, with augmented copies; 0 = off
    orientation: Literal["auto", "free", "fixed"]  # the policy's flips and turns: kept, dropped, or as the images say


@dataclass(frozen=True)
class ModelConfig:
    name: str  # a timm model name
    pretrained: str  # "false", "hub" or a path to a local weights file
    drop_rate: float
    global_pool: Literal["avg", "max", "avgmax"]  # max keeps a small defect from being averaged away
    input_norm: Literal["dataset", "per_image"]  # per_image: standardize each image (lighting-invariant)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int  # per process
    lr: float
    weight_decay: float
    warmup_epochs: int
    label_smoothing: float
    focal_gamma: float  # focal loss: (1 - p(true class)) ** gamma scales each image's cross-entropy; 0 = plain
    ranking_loss: float  # weight of a pairwise defect-vs-OK ranking term added to the cross-entropy; 0 = off
    mask_loss: float  # weight of the mask head's loss (where the data has defect masks); 0 = off
    grad_clip: float  # max global gradient norm; 0 = off
    ema: float  # decay of the exponential moving average of the weights; 0 = off
    # picks the kept model and drives early stopping; last: the final epoch (the end of the cosine schedule)
    monitor: Literal["val_loss", "val_auc", "val_recall_at_far", "last"]
    early_stopping_patience: int  # epochs without a better monitor value before stopping; 0 = off
    class_weighting: Literal["none", "loss", "sampling"]  # for imbalanced classes
    majority_per_epoch: float  # share of the most frequent class's images drawn anew in each epoch; 1 = all
    precision: Literal["auto", "fp32", "fp16", "bf16"]
    device: Literal["auto", "cpu", "cuda"]
    channels_last: bool  # weights in channels_last (NHWC) memory layout, like the uint8 NHWC input
    compile: bool  # torch.compile the model
    distributed: Literal["none", "ddp", "fsdp"]
    processes: int  # processes on this machine; ddp/fsdp launch themselves through torchrun
    checkpoint_every_steps: int  # also checkpoint inside an epoch; 0 = at the end of each epoch only
    keep_last: int  # training checkpoints kept
    keep_best: int  # consolidated best models kept (by the monitor)
    on_mismatch: Literal["restart", "stop"]  # a checkpoint of other params or data: start fresh, or stop
    num_workers: int
    threads: int  # torch intra-op threads on CPU; 0 = torch's default
    seed: int
    ensemble: int  # members trained with seeds seed, seed+1, ...; the model is the mean of their probabilities
    # per member, param changes ({"augment.policy": [...], "train.lr": ...}); [] = every member the same
    ensemble_members: list[dict[str, Any]]
    init_from: str  # none, champion (the registry's champion weights) or the path of a model.pt


@dataclass(frozen=True)
class TilesConfig:
    use: Literal["auto", "off"]  # auto: a tile model where the data has defect masks; off: whole images only
    weight: float  # share of the image's most suspicious tile in the fused probabilities
    keep_members: list[int]  # the train.ensemble members trained beside the tile model (the others are not)
    min_mask_pixels: int  # a training tile is a defect where its mask covers this many pixels (OK: none)
    recipe: dict[str, Any]  # the tile model's param changes (model.*, train.* keys), like a member's


@dataclass(frozen=True)
class EvaluateConfig:
    target_defect_recall: float  # the threshold is chosen on the val split to reach this recall
    max_false_alarm_rate: float  # also reported: test recall at the val threshold that keeps this FAR
    heatmaps_per_class: int  # test images per class drawn with their Grad-CAM heatmap (0 = off)


@dataclass(frozen=True)
class Int8Config:
    calibration_images: int  # drawn from the training split
    calibration_method: Literal["MinMax", "Entropy", "Percentile"]
    per_channel: bool  # per-output-channel weight scales
    op_types: list[str]  # op types quantized; all others stay float
    exclude_nodes: list[str]  # node names kept float even if their op type is listed


@dataclass(frozen=True)
class ExportConfig:
    opset: int
    max_abs_diff: float  # fp32 ONNX vs PyTorch, on class probabilities
    variants: list[Literal["fp32", "fp16", "int8"]]  # fp32 is always made
    int8: Int8Config
    max_defect_recall_drop: float  # a variant losing more defect recall than this vs fp32 is not deployable
    max_accuracy_drop: float
    max_false_alarm_rise: float  # the most the share of test OK images flagged at the card's threshold may rise
    min_speedup: dict[str, float]  # per variant, batch-1 latency vs fp32 on this machine's provider
    latency_repeats: int


@dataclass(frozen=True)
class BenchmarkConfig:
    batch_sizes: list[int]
    repeats: int
    warmup: int
    max_images: int
    rounds: int  # interleaved rounds for the end-to-end and HTTP comparisons
    http_concurrency: int  # closed-loop HTTP clients against `defect-runner serve`
    http_seconds: float  # per contender per round


@dataclass(frozen=True)
class PromoteRule:
    metric: Literal["defect_recall", "false_alarm_rate", "accuracy", "binary_accuracy"]
    better: Literal["higher", "lower"]
    tolerance: float  # differences up to this are a tie; the next rule decides


@dataclass(frozen=True)
class PromoteConfig:
    model_name: str  # the registered model in the MLflow model registry
    provider: Literal["cuda", "cpu"]  # whose recommended export variant is registered (the line's runners)
    rules: list[PromoteRule]  # in order; the first rule that is not a tie decides
    promote_on_tie: bool  # when every rule ties: move the champion to the newer model or keep it
    max_false_alarm_rate: float  # above this a model does not discriminate: never promoted, loses its title


@dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: str
    experiment: str


@dataclass(frozen=True)
class Params:
    data: DataConfig
    validate: ValidateConfig
    prepare: PrepareConfig
    augment: AugmentConfig
    model: ModelConfig
    train: TrainConfig
    tiles: TilesConfig
    evaluate: EvaluateConfig
    export: ExportConfig
    benchmark: BenchmarkConfig
    promote: PromoteConfig
    mlflow: MlflowConfig
    source_file: str = field(default="params.yaml", compare=False)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float where asked)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:  # YAML 1.1 reads a bare off (or no) as false
            value = "off"
        if value not in allowed or type(value) is not type(allowed[0]):  # noqa: E721 (1 != True here)
            raise ConfigError(f"{key}: expected one of {list(allowed)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        k_tp, v_tp = typing.get_args(tp)
        return {_convert(k, k_tp, key): _convert(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if isinstance(value, bool):  # YAML reads `false` as a bool; keep the user's word
            return str(value).lower()
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {key}")  # a bug in this file, not in params


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix or "params.yaml"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name != "source_file"}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{prefix + '.' if prefix else ''}{unknown[0]}: unknown key (known here: {known})")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in raw:
            if f.default is not dataclasses.MISSING:
                continue
            raise ConfigError(f"{key}: missing key")
        kwargs[name] = _convert(raw[name], hints[name], key)
    return cls(**kwargs)


def params_from_dict(raw: dict, source_file: str = "params.yaml", derived: bool = True) -> Params:
    """``derived``: also check the params each ensemble member and the tile model train with."""
    try:
        params = _build(Params, raw, "")
    except ConfigError as exc:
        raise ConfigError(f"{source_file}: {exc}") from None
    params = dataclasses.replace(params, source_file=source_file)
    _check_values(params)
    if derived:  # each member's and the tile model's params are checked now, not hours later
        for k in range(len(params.train.ensemble_members)):
            member_params(params, k)
        tile_params(params)
    return params


def _check_values(p: Params) -> None:
    """Cross-field rules that a type alone cannot say."""
    problems = []
    if p.prepare.split.val <= 0 or p.prepare.split.test <= 0 or p.prepare.split.val + p.prepare.split.test >= 0.9:
        problems.append("prepare.split: val and test must be > 0 and leave at least 10% for train")
    if p.prepare.image_size < 32:
        problems.append(f"prepare.image_size: must be at least 32 (EfficientNet), got {p.prepare.image_size}")
    if not 0 < p.evaluate.target_defect_recall <= 1:
        problems.append("evaluate.target_defect_recall: must be in (0, 1]")
    if p.data.source == "synthetic" and p.data.ok_class not in p.data.synthetic.counts:
        problems.append(f"data.ok_class: {p.data.ok_class!r} is not a class of data.synthetic.counts")
    t = p.train
    if t.epochs < 1 or t.batch_size < 1:
        problems.append("train.epochs and train.batch_size must be at least 1")
    if t.processes < 1:
        problems.append(f"train.processes: must be at least 1, got {t.processes}")
    if t.ensemble < 1:
        problems.append(f"train.ensemble: must be at least 1 (1 = a single model), got {t.ensemble}")
    if t.ensemble_members and len(t.ensemble_members) != t.ensemble:
        problems.append(
            f"train.ensemble_members: one entry per member (train.ensemble: {t.ensemble}), or [] for members "
            f"that differ only by seed; got {len(t.ensemble_members)}"
        )
    for k, changes in enumerate(t.ensemble_members):
        for key in changes:
            if not (key in MEMBER_AUGMENT or key.startswith(("train.", "model."))) or key in MEMBER_FIXED:
                problems.append(
                    f"train.ensemble_members[{k}]: {key}: a member may change augment.policy, augment.orientation, "
                    "model.* and train.* "
                    f"keys other than {', '.join(MEMBER_FIXED)} (the data and the export are the ensemble's)"
                )
    tl = p.tiles
    if not 0 < tl.weight <= 1:
        problems.append(f"tiles.weight: a share in (0, 1], got {tl.weight}")
    if not tl.keep_members or any(not 0 <= k < t.ensemble for k in tl.keep_members):
        problems.append(f"tiles.keep_members: indices of train.ensemble's members (0..{t.ensemble - 1}), at least "
                        f"one; got {tl.keep_members}")  # fmt: skip
    if tl.min_mask_pixels < 1:
        problems.append(f"tiles.min_mask_pixels: at least 1, got {tl.min_mask_pixels}")
    for key in tl.recipe:
        if not key.startswith(("train.", "model.")) or key in MEMBER_FIXED:
            problems.append(f"tiles.recipe: {key}: the tile model may change model.* and train.* keys other than "
                            f"{', '.join(MEMBER_FIXED)}")  # fmt: skip
    if t.processes > 1 and t.distributed == "none":
        problems.append("train.processes: more than 1 process needs train.distributed: ddp or fsdp")
    if t.monitor == "last" and t.early_stopping_patience:
        problems.append(
            "train.early_stopping_patience: needs a val monitor (val_loss, val_auc or val_recall_at_far); "
            "with train.monitor: last every epoch is the newest, so nothing would ever stop"
        )
    for key in ("focal_gamma", "ranking_loss", "mask_loss"):
        if getattr(t, key) < 0:
            problems.append(f"train.{key}: must be >= 0 (0 = off), got {getattr(t, key)}")
    if not 0 < t.majority_per_epoch <= 1:
        problems.append(
            f"train.majority_per_epoch: a share in (0, 1] (1 = every image every epoch), got {t.majority_per_epoch}"
        )
    if t.majority_per_epoch < 1 and t.class_weighting == "sampling":
        problems.append(
            "train.majority_per_epoch: only with train.class_weighting none or loss "
            "(class-balanced sampling already draws the classes evenly)"
        )
    if not 0 <= t.ema < 1:
        problems.append(f"train.ema: a decay in [0, 1), got {t.ema}")
    if t.keep_last < 1 or t.keep_best < 1:
        problems.append("train.keep_last and train.keep_best must be at least 1")
    if not p.promote.rules:
        problems.append("promote.rules: at least one rule (e.g. {metric: defect_recall, better: higher, tolerance: 0})")
    if any(r.tolerance < 0 for r in p.promote.rules):
        problems.append("promote.rules: every tolerance must be >= 0")
    if not 0 < p.promote.max_false_alarm_rate <= 1:
        problems.append(f"promote.max_false_alarm_rate: must be in (0, 1], got {p.promote.max_false_alarm_rate}")
    if p.evaluate.heatmaps_per_class < 0:
        problems.append("evaluate.heatmaps_per_class: must be >= 0 (0 = no heatmaps)")
    if problems:
        raise ConfigError(f"{p.source_file}: " + "; ".join(problems))


# The keys an ensemble member cannot change: they define the ensemble itself or how it is launched.
MEMBER_AUGMENT = ("augment.policy", "augment.orientation")  # how a member sees the images; the rest is the data's
MEMBER_FIXED = ("train.ensemble", "train.ensemble_members", "train.distributed", "train.processes")


def apply_changes(params: dict, changes: dict, where: str) -> dict:
    """A copy of the raw ``params`` with dotted keys set (``{"train.lr": 0.001}``). A key params.yaml does
    not have stops with ``where`` and the key named: a typo would otherwise be silently ignored."""
    out = copy.deepcopy(params)
    for dotted, value in changes.items():
        node, *path = out, *str(dotted).split(".")
        for i, part in enumerate(path[:-1]):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"{where}: {dotted}: params.yaml has no {'.'.join(path[: i + 1])}")
            node = node[part]
        if not isinstance(node, dict) or path[-1] not in node:
            raise ConfigError(f"{where}: {dotted}: params.yaml has no such key")
        node[path[-1]] = value
    return out


def member_params(p: Params, k: int) -> Params:
    """The params member ``k`` of ``train.ensemble`` trains with: seed ``train.seed + k`` and its entry of
    ``train.ensemble_members`` applied, checked like params.yaml (a bad value names the member)."""
    t = p.train
    raw = dataclasses.asdict(p)
    raw.pop("source_file")
    changes = {
        **(t.ensemble_members[k] if t.ensemble_members else {}),
        "train.seed": t.seed + k,
        "train.ensemble": 1,
        "train.ensemble_members": [],
        "tiles.keep_members": [0],  # of its one model
    }
    where = f"{p.source_file}: train.ensemble_members[{k}]"
    return params_from_dict(apply_changes(raw, changes, where), source_file=where)


def tile_params(p: Params) -> Params:
    """The params the tile model trains with: ``tiles.recipe`` applied, one model, no mask head (a tile's
    label is its mask's already), from scratch unless the recipe says ``train.init_from`` (the whole-image
    champion's weights are another network's), checked like params.yaml (a bad value names ``tiles.recipe``)."""
    raw = dataclasses.asdict(p)
    raw.pop("source_file")
    changes = {"train.init_from": "none", **p.tiles.recipe, "train.ensemble": 1, "train.ensemble_members": [],
               "train.mask_loss": 0.0, "tiles.keep_members": [0]}  # fmt: skip
    where = f"{p.source_file}: tiles.recipe"
    return params_from_dict(apply_changes(raw, changes, where), source_file=where, derived=False)


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found (run from the project root)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return params_from_dict(raw or {}, str(path))


def as_flat_dict(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 0.003, ...}`` for logging params to MLflow."""
    out: dict[str, Any] = {}
    items = dataclasses.asdict(obj).items() if dataclasses.is_dataclass(obj) else obj.items()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(as_flat_dict(v, key + "."))
        else:
            out[key] = v
    return out
