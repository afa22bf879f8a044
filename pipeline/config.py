"""Typed, frozen views of ``params.yaml``.

Every section of ``params.yaml`` maps one-to-one onto a frozen dataclass below, and pydantic checks the
raw YAML against them. ``load_params`` is strict: a missing key, an unknown key or a value of the wrong
type stops with a ``ConfigError`` that names the key, one line per problem
(``params.yaml: train.lr: expected a number, got 'fast'``), so a typo never silently falls back to a
default. Library code takes these objects, never a raw dict.

Why plain dataclasses checked by a pydantic ``TypeAdapter``, not pydantic models or
``pydantic.dataclasses``: the objects stay what they were, so positional construction
(``ModelConfig(name, "false", 0.0, ...)``), ``dataclasses.replace`` and ``dataclasses.asdict`` (used by the
stages, the tests and ``as_flat_dict``, hence the training fingerprint) work unchanged, and building one in
code checks nothing, as before. pydantic checks params where they come in (``params_from_dict``): the
types through the annotations (``Int``, ``Float``, ``Str``: YAML's loose scalars made strict, as the
hand-written checker was), then the rules a type cannot say (``_problems``), and ``load_params`` the files
that params name.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, dataclass_transform

import yaml
from pydantic import BeforeValidator, ConfigDict, Strict, TypeAdapter, ValidationError, with_config
from pydantic_core import ErrorDetails, PydanticCustomError


class ConfigError(ValueError):
    """A problem in params.yaml; the message names the key."""


class StageError(RuntimeError):
    """A stage's own check failed (a data gate, the export parity): the message says which figure and
    why; the stage exits 2 with that line, no traceback. Defined here, beside ConfigError, so every
    stage can catch it without importing the heavy module that raises it."""


def _yaml_word(value: Any) -> Any:
    """YAML reads ``false`` as a bool and ``0.5`` as a number where a string is meant: keep the user's word."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if isinstance(value, int | float) else value


def _exact_int(value: Any) -> Any:
    """pydantic's Literal[1, 3] takes true and 1.0 as 1; params.yaml means the integer."""
    if isinstance(value, bool | float):
        raise PydanticCustomError("literal_error", "not an integer")
    return value


Int = Annotated[int, Strict()]  # 2.5, "2" and true are errors, not 2 and 1
Float = Annotated[float, Strict()]  # an integer widens (4 -> 4.0); "fast" and true are errors
Bool = Annotated[bool, Strict()]  # true or false only
Str = Annotated[str, BeforeValidator(_yaml_word), Strict()]  # false and 0.5 stay the words "false", "0.5"
Variant = Literal["fp32", "fp16", "int8"]  # the export's ONNX variants
SYNTHETIC_CLASSES = ("ok", "scratch", "spot", "crack")  # pipeline/data/synthetic.py's CLASSES (config imports none)
NO_OK_CLASS = "none"  # data.ok_class for defect-type sorting: every class is a defect type, no threshold

T = TypeVar("T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def section(cls: type[T]) -> type[T]:
    """A frozen dataclass of one params section; pydantic refuses keys it does not declare."""
    return with_config(ConfigDict(extra="forbid"))(dataclass(frozen=True)(cls))


@section
class SyntheticConfig:
    counts: dict[Str, Int]  # images per class; "ok" plus any of scratch, spot, crack
    image_size: Int  # side of the square images the generator writes
    contrast: Float  # multiplies every defect's contrast (1: the faint ones at 3-4 texture std)


@section
class DataConfig:
    source: Str  # "synthetic" or a folder with one subfolder per class
    ok_class: Str  # the class that means "no defect"; "none" (NO_OK_CLASS): defect-type sorting, no OK class
    channels: Annotated[Literal[1, 3], BeforeValidator(_exact_int)]  # channels the model sees; images are converted
    seed: Int
    synthetic: SyntheticConfig


@section
class ValidateConfig:
    min_side: Int  # smaller images are quarantined
    max_pixels: Int  # larger images are refused before decoding (decompression bombs)
    min_per_class: Int  # the gate fails if an accepted class has fewer images
    max_bad_fraction: Float  # the gate fails if a larger share of files is quarantined
    max_label_conflicts: Int  # the gate fails if more files show the same content under two labels
    near_duplicate_bits: Int  # perceptual hashes (256 bits) this close are one near-duplicate group


@section
class SplitConfig:
    val: Float
    test: Float


@section
class PrepareConfig:
    image_size: Int | Literal["auto"]  # model input side, pixels; auto: from the images' own resolution
    resize: Literal["letterbox", "squash"]
    split: SplitConfig


@section
class AugmentConfig:
    policy: list[dict[Str, Any]]  # albumentations transforms: [{name: HorizontalFlip, p: 0.5}, ...]
    preview_per_class: Int
    balance: Float  # raise each class to this share of the largest in train, with augmented copies; 0 = off
    orientation: Literal["auto", "free", "fixed"]  # the policy's flips and turns: kept, dropped, or as the images say


@section
class ModelConfig:
    name: Str  # a timm model name
    pretrained: Str  # "false", "hub" or a path to a local weights file
    drop_rate: Float
    global_pool: Literal["avg", "max", "avgmax"]  # max keeps a small defect from being averaged away
    input_norm: Literal["dataset", "per_image"]  # per_image: standardize each image (lighting-invariant)


@section
class TrainConfig:
    epochs: Int
    batch_size: Int  # per process
    lr: Float
    weight_decay: Float
    warmup_epochs: Int
    label_smoothing: Float
    focal_gamma: Float  # focal loss: (1 - p(true class)) ** gamma scales each image's cross-entropy; 0 = plain
    ranking_loss: Float  # weight of a pairwise defect-vs-OK ranking term added to the cross-entropy; 0 = off
    mask_loss: Float  # weight of the mask head's loss (where the data has defect masks); 0 = off
    grad_clip: Float  # max global gradient norm; 0 = off
    ema: Float  # decay of the exponential moving average of the weights; 0 = off
    # picks the kept model and drives early stopping; last: the final epoch (the end of the cosine schedule)
    monitor: Literal["val_loss", "val_auc", "val_recall_at_far", "last"]
    early_stopping_patience: Int  # epochs without a better monitor value before stopping; 0 = off
    class_weighting: Literal["none", "loss", "sampling"]  # for imbalanced classes
    majority_per_epoch: Float  # share of the most frequent class's images drawn anew in each epoch; 1 = all
    precision: Literal["auto", "fp32", "fp16", "bf16"]
    device: Literal["auto", "cpu", "cuda"]
    channels_last: Bool  # weights in channels_last (NHWC) memory layout, like the uint8 NHWC input
    compile: Bool  # torch.compile the model
    distributed: Literal["none", "ddp", "fsdp"]
    processes: Int  # processes on this machine; ddp/fsdp launch themselves through torchrun
    checkpoint_every_steps: Int  # also checkpoint inside an epoch; 0 = at the end of each epoch only
    keep_last: Int  # training checkpoints kept
    keep_best: Int  # consolidated best models kept (by the monitor)
    on_mismatch: Literal["restart", "stop"]  # a checkpoint of other params or data: start fresh, or stop
    num_workers: Int
    threads: Int  # torch intra-op threads on CPU; 0 = torch's default
    seed: Int
    ensemble: Int  # members trained with seeds seed, seed+1, ...; the model is the mean of their probabilities
    # per member, param changes ({"augment.policy": [...], "train.lr": ...}); [] = every member the same
    ensemble_members: list[dict[Str, Any]]
    init_from: Str  # none, champion (the registry's champion weights) or the path of a model.pt


def _yaml_off(value: Any) -> Any:
    return "off" if value is False else value  # YAML 1.1 reads a bare off (or no) as false


@section
class TilesConfig:
    # auto: a tile model where the data has defect masks; off: whole images only
    use: Annotated[Literal["auto", "off"], BeforeValidator(_yaml_off)]
    weight: Float  # share of the image's most suspicious tile in the fused probabilities
    keep_members: list[Int]  # the train.ensemble members trained beside the tile model (the others are not)
    min_mask_pixels: Int  # a training tile is a defect where its mask covers this many pixels (OK: none)
    recipe: dict[Str, Any]  # the tile model's param changes (model.*, train.* keys), like a member's


@section
class EvaluateConfig:
    target_defect_recall: Float  # the card's threshold catches this share of val defects, if the ceiling allows
    max_false_alarm_rate: Float  # the ceiling: the card's threshold never flags more of the val OK images
    heatmaps_per_class: Int  # test images per class drawn with their Grad-CAM heatmap (0 = off)


@section
class Int8Config:
    calibration_images: Int  # drawn from the training split
    calibration_method: Literal["MinMax", "Entropy", "Percentile"]
    per_channel: Bool  # per-output-channel weight scales
    op_types: list[Str]  # op types quantized; all others stay float
    exclude_nodes: list[Str]  # node names kept float even if their op type is listed


@section
class ExportConfig:
    opset: Int
    max_abs_diff: Float  # fp32 ONNX vs PyTorch, on class probabilities
    variants: list[Variant]  # fp32 is always made
    int8: Int8Config
    max_defect_recall_drop: Float  # a variant losing more defect recall (sorting: any class's recall) is not deployable
    max_accuracy_drop: Float
    max_false_alarm_rise: Float  # the most the share of test OK images flagged at the card's threshold may rise
    min_speedup: dict[Variant, Float]  # per variant, batch-1 latency vs fp32 on this machine's provider
    deploy_below_target: Bool  # an operating point below the recall target is deployable all the same
    latency_repeats: Int


@section
class BenchmarkConfig:
    batch_sizes: list[Int]
    repeats: Int
    warmup: Int
    max_images: Int
    rounds: Int  # interleaved rounds for the end-to-end and HTTP comparisons
    http_concurrency: Int  # closed-loop HTTP clients against `defect-runner serve`
    http_seconds: Float  # per contender per round


@section
class PromoteRule:
    metric: Literal["defect_recall", "false_alarm_rate", "accuracy", "binary_accuracy", "min_class_recall"]
    better: Literal["higher", "lower"]
    tolerance: Float  # differences up to this are a tie; the next rule decides


@section
class PromoteConfig:
    model_name: Str  # the registered model in the MLflow model registry
    provider: Literal["cuda", "cpu"]  # whose recommended export variant is registered (the line's runners)
    rules: list[PromoteRule]  # in order; the first rule that is not a tie decides
    sorting_rules: list[PromoteRule]  # the same, for defect-type sorting (data.ok_class: none)
    promote_on_tie: Bool  # when every rule ties: move the champion to the newer model or keep it
    refuse_false_alarm_rate: Float  # flagging more OK images than this at its own threshold: never champion


@section
class MlflowConfig:
    tracking_uri: Str
    experiment: Str


@section
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
    source_file: str = field(default="params.yaml", compare=False)  # set by the loader, not a params.yaml key


_SCHEMA = TypeAdapter(Params)

# What each pydantic error type of a wrong value expected, in the words of params.yaml.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
}


def _annotation_at(loc: tuple) -> Any:
    """The type params.yaml's value at pydantic's ``loc`` (keys and list indices) must have."""
    tp: Any = Params
    for part in loc:
        # a section's field (Annotated stripped: Int is int), or list[item] / dict[key, value]'s value type
        tp = typing.get_type_hints(tp).get(part, Any) if dataclasses.is_dataclass(tp) else typing.get_args(tp)[-1]
    return tp


def _problem(err: ErrorDetails) -> str:
    """One pydantic error as one line naming the dotted key: ``train.lr: expected a number, got 'fast'``."""
    loc, got, kind = err["loc"], err["input"], err["type"]
    in_key = loc[-1:] == ("[key]",)  # a mapping's key is wrong, not its value: name the mapping
    loc = loc[:-2] if in_key else loc
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if kind == "missing":
        what = "missing key"
    elif kind in ("unexpected_keyword_argument", "extra_forbidden"):
        known = sorted(f.name for f in dataclasses.fields(_annotation_at(loc[:-1])) if f.name != "source_file")
        what = f"unknown key (known here: {', '.join(known)})"
    elif kind == "literal_error":
        tp = _annotation_at(loc)
        what = f"expected one of {list(typing.get_args(typing.get_args(tp)[0] if in_key else tp))}, got {got!r}"
    elif kind in _EXPECTED:
        what = f"expected {_EXPECTED[kind]}, got {got!r}"
    else:  # a type this file does not use yet: pydantic's own words
        what = f"{err['msg']}, got {got!r}"
    return f"{key}: {what}" if key else what


def _error(source_file: str, problems: list[str]) -> ConfigError:
    return ConfigError("\n".join(f"{source_file}: {p}" for p in problems))


def params_from_dict(raw: dict, source_file: str = "params.yaml", derived: bool = True) -> Params:
    """``derived``: also check the params each ensemble member and the tile model train with."""
    if isinstance(raw, dict) and "source_file" in raw:  # a field of Params, but the loader's, not the user's
        raise _error(source_file, ["source_file: unknown key (set by the loader, not in params.yaml)"])
    try:
        params = _SCHEMA.validate_python(raw)
    except ValidationError as exc:
        raise _error(source_file, [_problem(err) for err in exc.errors()]) from None
    params = dataclasses.replace(params, source_file=source_file)
    if problems := _problems(params):
        raise _error(source_file, problems)
    if derived:  # the tile model's and each member's params are checked now, not hours later
        tile_params(params)
        for k in range(len(params.train.ensemble_members)):
            member_params(params, k)
    return params


def _problems(p: Params) -> list[str]:
    """The rules that a type alone cannot say, one line each."""
    problems = [*_data_problems(p), *_train_problems(p.train), *_tiles_problems(p), *_output_problems(p)]
    return problems + (_sorting_problems(p) if p.data.ok_class == NO_OK_CLASS else [])


def _sorting_problems(p: Params) -> list[str]:
    """Defect-type sorting has no OK class: the levers that rank defects against OK images do not apply."""
    problems = []
    if p.train.ranking_loss:
        problems.append("train.ranking_loss: ranks defects above OK images; with data.ok_class: none set it to 0")
    if p.train.monitor in ("val_recall_at_far", "val_auc"):
        problems.append(
            f"train.monitor: {p.train.monitor} scores defects against OK images; with data.ok_class: none use "
            "last or val_loss"
        )
    return problems


def _data_problems(p: Params) -> list[str]:
    problems = []
    if p.prepare.split.val <= 0 or p.prepare.split.test <= 0 or p.prepare.split.val + p.prepare.split.test >= 0.9:
        problems.append("prepare.split: val and test must be > 0 and leave at least 10% for train")
    if p.prepare.image_size != "auto" and p.prepare.image_size < 32:
        problems.append(f"prepare.image_size: must be at least 32 (EfficientNet), got {p.prepare.image_size}")
    counts = p.data.synthetic.counts
    if p.data.source == "synthetic" and p.data.ok_class not in {*counts, NO_OK_CLASS}:
        problems.append(f"data.ok_class: {p.data.ok_class!r} is not a class of data.synthetic.counts")
    if p.data.source == "synthetic" and (set(counts) - set(SYNTHETIC_CLASSES) or min(counts.values(), default=0) < 0):
        problems.append(
            f"data.synthetic.counts: the generator's classes are {', '.join(SYNTHETIC_CLASSES)}, each "
            f"with a count >= 0; got {counts}"
        )
    if p.augment.policy:
        problems += _policy_problems(p.augment.policy, "augment.policy")
    return problems


def _policy_problems(specs: Any, key: str) -> list[str]:
    """Each transform of an augment policy names an albumentations transform and only arguments it takes,
    as pipeline/data/augment.py will ask when it builds the policy (nested ``transforms`` too)."""
    import albumentations as A  # here, not at the top: 1.7-2.8 s to import (it imports torch), measured here

    if not isinstance(specs, list):
        return [f"{key}: expected a list of transforms, got {specs!r}"]
    problems = []
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        if not isinstance(spec, dict) or "name" not in spec:
            problems.append(f"{where}: expected a mapping with a 'name' key, got {spec!r}")
            continue
        cls = getattr(A, str(spec["name"]), None)
        if not (isinstance(cls, type) and issubclass(cls, A.BasicTransform | A.BaseCompose)):
            problems.append(f"{where}.name: {spec['name']!r} is not an albumentations transform")
            continue
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
        unknown = sorted(set(spec) - accepted - {"name"})
        if unknown:
            problems.append(
                f"{where}: {spec['name']} has no argument {unknown[0]!r} (it takes: {', '.join(sorted(accepted))})"
            )
        if "transforms" in spec:
            problems += _policy_problems(spec["transforms"], f"{where}.transforms")
    return problems


def _train_problems(t: TrainConfig) -> list[str]:
    problems = []
    if t.epochs < 1 or t.batch_size < 1:
        problems.append("train.epochs and train.batch_size must be at least 1")
    if t.lr < 0:  # 0 is allowed: the tests train a model that learns nothing on purpose
        problems.append(f"train.lr: must be >= 0 (0 = the weights never change), got {t.lr}")
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
    return problems


def _tiles_problems(p: Params) -> list[str]:
    problems, tl, t = [], p.tiles, p.train
    if not 0 < tl.weight <= 1:
        problems.append(f"tiles.weight: a share in (0, 1], got {tl.weight}")
    if not tl.keep_members or any(not 0 <= k < t.ensemble for k in tl.keep_members):
        problems.append(
            f"tiles.keep_members: indices of train.ensemble's members (0..{t.ensemble - 1}), at least "
            f"one; got {tl.keep_members}"
        )
    if tl.min_mask_pixels < 1:
        problems.append(f"tiles.min_mask_pixels: at least 1, got {tl.min_mask_pixels}")
    for key in tl.recipe:
        if not key.startswith(("train.", "model.")) or key in MEMBER_FIXED:
            problems.append(
                f"tiles.recipe: {key}: the tile model may change model.* and train.* keys other than "
                f"{', '.join(MEMBER_FIXED)}"
            )
    return problems


def _output_problems(p: Params) -> list[str]:
    problems = []
    if not 0 < p.evaluate.target_defect_recall <= 1:
        problems.append("evaluate.target_defect_recall: must be in (0, 1]")
    if not 0 < p.evaluate.max_false_alarm_rate <= 1:
        problems.append(
            f"evaluate.max_false_alarm_rate: a share in (0, 1] (1: no ceiling), got {p.evaluate.max_false_alarm_rate}"
        )
    if p.evaluate.heatmaps_per_class < 0:
        problems.append("evaluate.heatmaps_per_class: must be >= 0 (0 = no heatmaps)")
    if not p.benchmark.batch_sizes or min(p.benchmark.batch_sizes) < 1:
        problems.append(f"benchmark.batch_sizes: at least one, each at least 1; got {p.benchmark.batch_sizes}")
    if not p.promote.rules:
        problems.append("promote.rules: at least one rule (e.g. {metric: defect_recall, better: higher, tolerance: 0})")
    if not p.promote.sorting_rules:
        problems.append(
            "promote.sorting_rules: at least one rule (e.g. {metric: accuracy, better: higher, tolerance: 0})"
        )
    for key in ("rules", "sorting_rules"):
        if any(r.tolerance < 0 for r in getattr(p.promote, key)):
            problems.append(f"promote.{key}: every tolerance must be >= 0")
    binary_only = {"defect_recall", "false_alarm_rate", "binary_accuracy"}
    if any(r.metric in binary_only for r in p.promote.sorting_rules):
        problems.append(
            f"promote.sorting_rules: without an OK class there is no {'/'.join(sorted(binary_only))}; "
            "use min_class_recall and accuracy"
        )
    if not 0 < p.promote.refuse_false_alarm_rate <= 1:
        problems.append(f"promote.refuse_false_alarm_rate: must be in (0, 1], got {p.promote.refuse_false_alarm_rate}")
    return problems


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
    changes = {
        "train.init_from": "none",
        **p.tiles.recipe,
        "train.ensemble": 1,
        "train.ensemble_members": [],
        "train.mask_loss": 0.0,
        "tiles.keep_members": [0],
    }
    where = f"{p.source_file}: tiles.recipe"
    return params_from_dict(apply_changes(raw, changes, where), source_file=where, derived=False)


def load_params(path: str | Path = "params.yaml", stage: str | None = None) -> Params:
    """The checked params of ``path``; the files they name are checked for ``stage`` (every one when None):
    data.source for ingest, model.pretrained for train, so a clone that pulled data/ with ``dvc pull``
    runs the later stages without the source folder."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found (run from the project root)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return checked_params(raw or {}, str(path), stage)


def checked_params(raw: dict, source_file: str, stage: str | None = None) -> Params:
    """``raw`` params checked like params.yaml, and the files they name checked for ``stage``."""
    params = params_from_dict(raw, source_file)
    problems = _file_problems(params, stage)
    if problems:
        raise ConfigError("\n".join(problems))
    return params


def _file_problems(p: Params, stage: str | None = None) -> list[str]:
    """The folder and weights files params name exist where the stages will look: a relative path is read
    from the working directory, as the stages read it (they run in the project root, beside params.yaml).
    Each line starts with the key (the ingest stage's own words), then names the params file."""
    where = f"(set in {p.source_file}; working directory {Path.cwd()})"
    problems = []
    source = Path(p.data.source)
    if stage in (None, "ingest") and p.data.source != "synthetic" and not source.is_dir():
        what = "is not a folder (expected one subfolder per class)" if source.exists() else "does not exist"
        problems.append(f"data.source: folder {source} {what} {where}")
    if stage not in (None, "train"):
        return problems
    views = {"": p, "tiles.recipe: ": tile_params(p)}
    views |= {f"train.ensemble_members[{k}]: ": member_params(p, k) for k in range(len(p.train.ensemble_members))}
    for who, view in views.items():
        weights = view.model.pretrained
        if who and weights == p.model.pretrained:
            continue  # the member or tile model keeps model.pretrained: named once, above
        if weights not in ("false", "hub", "", "none") and not Path(weights).is_file():
            problems.append(f"{who}model.pretrained: weights file {weights} not found {where}")
    return problems


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
