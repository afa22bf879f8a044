"""The model card: everything the runner needs to know about an exported model, and nothing guessed.

Export writes it twice: as a sidecar JSON next to the ONNX file (``<model>.card.json``, with the
file's sha256) and inside the ONNX metadata (``model_card``, without the sha256, which cannot hash
the file that contains it), together with ``model_card_sha256``: the sha256 of the card's canonical
JSON (``canonical_json``: every field but ``sha256``, keys sorted, no spaces).

Two kinds of card, told apart by ``ok_class`` (``ModelCard.sorting``):

- **defect detection** (binary): ``ok_class`` names the class that means "no defect" and ``threshold`` is a
  number in [0, 1]; the graph's ``defect_score`` is 1 - p(ok) and an image is "defect" when
  ``defect_score >= threshold``.
- **defect-type sorting** (every image is a defect, e.g. the NEU steel dataset): ``ok_class`` and
  ``threshold`` are both null, ``tiles`` is null, and ``outputs`` is ``SORTING_OUTPUTS``: the graph's
  ``defect_score`` is the most likely class's probability (the max over K) and the decision is that class.

``operating_point`` (optional, a JSON object; left out of the JSON when empty) is what the evaluate stage
measured at the card's threshold, e.g. ``{"status": "below target", "target_defect_recall": 0.99,
"val_defect_recall": 0.93, ...}``: the runner warns at load when its status is "below target"
(``serving.runner.review_warning``) and the server shows it in its model metadata.

Nothing in a card is trusted before it is checked (``ModelCard.read``):

- **schema**: every field has its type (a boolean is ``true``/``false``, never the string ``"false"``;
  an integer is never a float or a boolean), the threshold is a finite number in [0, 1] (null together
  with ``ok_class`` for a sorting card, and only then), the classes are at least two unique non-empty
  strings with ``ok_class`` among them, the variant is a known one, the input side and channels are
  positive integers, a tile graph is named by a bare file name beside the model, ``operating_point`` is a
  JSON object. All problems are reported at once, each naming the field and the file.
- **integrity** (``check_card_against_graph``, called by the runner on the graph's metadata): the
  sidecar's canonical sha256 must be the ``model_card_sha256`` that export recorded inside the model
  (whose bytes the sidecar's ``sha256`` covers), so an edited threshold or a reordered class list in the
  sidecar is refused, naming the fields that differ from the embedded card. A model exported before
  that hash was recorded is checked field by field against its embedded ``model_card`` instead (equally
  strict; a log line asks for a re-export). A graph with no embedded card at all (built by hand, or by
  another tool) loads with a warning: its card is checked against the schema and the graph's shapes,
  but an edit to it cannot be seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CARD_VERSION = 1
VARIANTS = ("fp32", "fp16", "int8")
PROVIDERS = ("cpu", "cuda", "tensorrt")  # keys of ``recommended``
METADATA_CARD = "model_card"  # ONNX metadata key: the card as JSON, without ``sha256``
METADATA_CARD_SHA256 = "model_card_sha256"  # ONNX metadata key: ``card_sha256`` of that card
MAX_CARD_BYTES = 1 << 20  # a card is a few kB; a larger file is not a card
_SHA256 = re.compile(r"[0-9a-f]{64}")
# How export's gate begins the reason of a model marked for review (its operating point below target); the
# runner loads such a model with a warning, while any other reason needs force. Reasons are joined by "; ".
REVIEW_REASON = "marked for review"
BINARY_OUTPUTS = {"probs": "(N, K) float32 class probabilities", "defect_score": "(N,) 1 - p(ok)"}
SORTING_OUTPUTS = {
    "probs": "(N, K) float32 class probabilities",
    "defect_score": "(N,) the most likely class's probability (defect-type sorting: no OK class)",
}
BINARY_DECISIONS = ("defect", "ok")  # a binary card's decisions; a sorting card decides one of its classes


class CardError(ValueError):
    """The model card is missing, malformed, or does not match the model file."""


@dataclass(frozen=True)
class InputSpec:
    size: int  # square side in pixels
    channels: int  # 1 (grayscale) or 3 (RGB)
    resize: str  # "letterbox" or "squash", see serving.preprocess.resize_image
    layout: str = "NHWC"
    dtype: str = "uint8"


@dataclass(frozen=True)
class TileSpec:
    """A second graph beside the whole-image one: it scores the photograph cut at 1:1 into ``size`` px tiles
    (``serving.tiles``); the image's fused probabilities weigh its most suspicious tile by ``weight``."""

    model: str  # the tile graph's file name, beside the whole-image graph
    sha256: str  # of that file
    size: int  # tile side in pixels (the tile graph's input side)
    weight: float  # share of the tile view in the fused probabilities
    architecture: str = ""  # timm model name


@dataclass(frozen=True)
class ModelCard:
    name: str  # registered model name
    architecture: str  # timm model name
    classes: list[str]
    ok_class: str | None  # None: defect-type sorting (no OK class, no threshold)
    input: InputSpec
    threshold: float | None  # defect_score >= threshold -> "defect"; None exactly when ok_class is None
    variant: str = "fp32"
    deployable: bool = True
    not_deployable_reason: str = ""
    sha256: str = ""
    training_run_id: str = ""
    data_fingerprint: str = ""
    parity: dict[str, Any] = field(default_factory=dict)
    recommended: dict[str, str] = field(default_factory=dict)  # execution provider -> variant to run there
    outputs: dict[str, str] = field(default_factory=lambda: dict(BINARY_OUTPUTS))  # SORTING_OUTPUTS for sorting
    tiles: TileSpec | None = None  # None: the whole-image graph alone decides
    operating_point: dict[str, Any] = field(default_factory=dict)  # the evaluate stage's figures at the threshold
    card_version: int = CARD_VERSION

    @property
    def sorting(self) -> bool:
        """Defect-type sorting: no OK class and no threshold; the decision is the most likely class."""
        return self.ok_class is None

    @property
    def ok_index(self) -> int:
        """The OK class's column in ``probs``. A sorting card has none: asking is a CardError, never a guess
        (a None here would index numpy arrays as a new axis without a word)."""
        if self.ok_class is None:
            raise CardError(
                f"model card {self.name!r}: ok_class is null (defect-type sorting), so there is no OK class index; "
                "a sorting card decides by the most likely class"
            )
        return self.classes.index(self.ok_class)

    @property
    def decisions(self) -> tuple[str, ...]:
        """Every decision this card can give: "defect" and "ok", or for a sorting card its classes."""
        return tuple(self.classes) if self.sorting else BINARY_DECISIONS

    def as_dict(self) -> dict[str, Any]:
        """The card as its JSON holds it. An empty ``operating_point`` is left out, so a card without one
        is written, embedded and hashed exactly as cards were before the field existed."""
        body = dataclasses.asdict(self)
        if not body["operating_point"]:
            del body["operating_point"]
        return body

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "model card") -> ModelCard:
        """A card from parsed JSON, refused with every schema problem listed (each names its field)."""
        if not isinstance(raw, dict):
            raise CardError(f"{where}: a model card is a JSON object, got {type(raw).__name__}")
        raw = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in raw.items()}
        problems = card_problems(raw)
        if problems:
            raise CardError(f"{where}: " + "; ".join(problems))
        tiles, threshold = raw.get("tiles"), raw["threshold"]
        if tiles is not None:
            tiles = TileSpec(**{**tiles, "weight": float(tiles["weight"])})
        threshold = None if threshold is None else float(threshold)
        return cls(**{**raw, "input": InputSpec(**raw["input"]), "tiles": tiles, "threshold": threshold})

    @classmethod
    def read(cls, path: str | Path) -> ModelCard:
        path = Path(path)
        if not path.is_file():
            raise CardError(f"{path}: model card not found (export writes it beside the model)")
        try:
            raw = json.loads(read_regular_file(path, MAX_CARD_BYTES))
        except OSError as exc:
            raise CardError(f"{path}: cannot read the model card: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CardError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(raw, str(path))

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


# --- the schema -------------------------------------------------------------------------------------------
# A check takes the value and returns what is wrong with it ('' when nothing is).


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _string(v: Any) -> str:
    return "" if isinstance(v, str) else f"must be a string, got {v!r}"


def _nonempty(v: Any) -> str:
    return "" if isinstance(v, str) and v.strip() else f"must be a non-empty string, got {v!r}"


def _boolean(v: Any) -> str:
    return "" if isinstance(v, bool) else f"must be true or false (a JSON boolean), got {v!r}"


def _positive_int(v: Any) -> str:
    return "" if _is_int(v) and v > 0 else f"must be a positive integer, got {v!r}"


def _one_of(*allowed: Any):
    def check(v: Any) -> str:
        ok = isinstance(v, str | int) and not isinstance(v, bool) and v in allowed
        return "" if ok else f"must be one of {', '.join(map(repr, allowed))}, got {v!r}"

    return check


def _nested(v: Any) -> str:
    return ""  # ``input`` and ``tiles`` are checked field by field in card_problems


def _ok_class(v: Any) -> str:
    ok = v is None or (isinstance(v, str) and v.strip())  # null: a sorting card (_sorting_problems checks the pair)
    return "" if ok else f"must be a non-empty string, or null for a defect-type sorting card, got {v!r}"


def _threshold(v: Any) -> str:
    ok = v is None or (_is_number(v) and math.isfinite(v) and 0.0 <= v <= 1.0)  # null: see _ok_class
    return "" if ok else f"must be a finite number in [0, 1], got {v!r}"


def _weight(v: Any) -> str:
    ok = _is_number(v) and math.isfinite(v) and 0.0 < v <= 1.0
    return "" if ok else f"must be a finite number in (0, 1], got {v!r}"


def _sha256(v: Any) -> str:
    return "" if isinstance(v, str) and _SHA256.fullmatch(v) else f"must be 64 lowercase hex digits, got {v!r}"


def _sha256_or_empty(v: Any) -> str:
    return "" if v == "" else _sha256(v)


def _classes(v: Any) -> str:
    if not isinstance(v, list) or len(v) < 2:
        return f"must be a list of at least two class names, got {v!r}"
    if not all(isinstance(c, str) and c.strip() for c in v):
        return f"must hold only non-empty strings, got {v!r}"
    dupes = sorted({c for c in v if v.count(c) > 1})
    return f"must not repeat a class, {dupes[0]!r} appears more than once" if dupes else ""


def _object(value_check=None, keys: tuple[str, ...] = ()):
    def check(v: Any) -> str:
        if not isinstance(v, dict):
            return f"must be a JSON object, got {v!r}"
        bad_keys = [k for k in v if keys and k not in keys]
        if bad_keys:
            return f"unknown key {bad_keys[0]!r} (expected {', '.join(keys)})"
        bad = [(k, value_check(x)) for k, x in v.items() if value_check and value_check(x)]
        return f"key {bad[0][0]!r} {bad[0][1]}" if bad else ""

    return check


def _tile_name(v: Any) -> str:
    """A bare file name beside the model: a path would let a card point the runner anywhere."""
    ok = isinstance(v, str) and v and v not in (".", "..") and "/" not in v and "\\" not in v and "\0" not in v
    return "" if ok else f"must be a file name beside the model (no folders), got {v!r}"


INPUT_FIELDS = {
    "size": _positive_int,
    "channels": _one_of(1, 3),
    "resize": _one_of("letterbox", "squash"),
    "layout": _one_of("NHWC"),
    "dtype": _one_of("uint8"),
}
TILE_FIELDS = {
    "model": _tile_name,
    "sha256": _sha256,
    "size": _positive_int,
    "weight": _weight,
    "architecture": _string,
}
CARD_FIELDS = {
    "name": _nonempty,
    "architecture": _string,
    "classes": _classes,
    "ok_class": _ok_class,
    "threshold": _threshold,
    "variant": _one_of(*VARIANTS),
    "deployable": _boolean,
    "not_deployable_reason": _string,
    "sha256": _sha256_or_empty,
    "training_run_id": _string,
    "data_fingerprint": _string,
    "parity": _object(),
    "recommended": _object(_one_of(*VARIANTS), PROVIDERS),
    "outputs": _object(_string),
    "card_version": _one_of(CARD_VERSION),
    "input": _nested,
    "tiles": _nested,
    "operating_point": _object(),  # its keys are the evaluate stage's to choose: only the type is checked
}


def _fields_problems(raw: dict, checks: dict, required: set[str], prefix: str = "") -> list[str]:
    problems = [f"unknown field '{prefix}{k}'" for k in raw if k not in checks]
    problems += [f"missing field '{prefix}{k}'" for k in checks if k in required and k not in raw]
    for k, check in checks.items():
        why = check(raw[k]) if k in raw else ""
        if why:
            problems.append(f"field '{prefix}{k}' {why}")
    return problems


def _required(cls) -> set[str]:
    return {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    }


def card_problems(raw: dict) -> list[str]:
    """Everything wrong with a card's parsed JSON, each naming its field; [] for a good card."""
    problems = _fields_problems(raw, CARD_FIELDS, _required(ModelCard))
    spec = raw.get("input")
    if "input" in raw and not isinstance(spec, dict):
        problems.append(f"field 'input' must be a JSON object, got {spec!r}")
    elif isinstance(spec, dict):
        problems += _fields_problems(spec, INPUT_FIELDS, _required(InputSpec), "input.")
    tiles = raw.get("tiles")
    if tiles is not None and not isinstance(tiles, dict):
        problems.append(f"field 'tiles' must be a JSON object or null, got {tiles!r}")
    elif isinstance(tiles, dict):
        problems += _fields_problems(tiles, TILE_FIELDS, _required(TileSpec), "tiles.")
    ok, classes = raw.get("ok_class"), raw.get("classes")
    if isinstance(ok, str) and isinstance(classes, list) and ok not in classes:
        problems.append(f"field 'ok_class' {ok!r} is not one of classes {classes}")
    return problems + _sorting_problems(raw)


def _sorting_problems(raw: dict) -> list[str]:
    """The null rules: ``ok_class`` and ``threshold`` are null together (a sorting card) or not at all, and
    a sorting card has no tile graph and says what its ``defect_score`` is (``SORTING_OUTPUTS``)."""
    if "ok_class" not in raw or "threshold" not in raw:
        return []  # reported as missing
    ok, threshold = raw["ok_class"], raw["threshold"]
    if ok is not None:
        if threshold is None:
            return [
                f"field 'threshold' is null, but only a sorting card (ok_class null) has no threshold: a card with "
                f"ok_class {ok!r} needs a finite number in [0, 1]"
            ]
        return []
    problems = []
    if threshold is not None:
        problems.append(
            f"field 'threshold' must be null when 'ok_class' is null (defect-type sorting decides by the most "
            f"likely class, with no threshold), got {threshold!r}"
        )
    if raw.get("tiles") is not None:
        problems.append(
            "field 'tiles' must be null for a sorting card (ok_class null): the tile view picks the tile with the "
            "highest 1 - p(ok)"
        )
    outputs = raw.get("outputs", BINARY_OUTPUTS)
    if outputs != SORTING_OUTPUTS:
        problems.append(
            f"field 'outputs' must be {json.dumps(SORTING_OUTPUTS)} for a sorting card (ok_class null), "
            f"got {json.dumps(outputs)}"
        )
    return problems


# --- integrity --------------------------------------------------------------------------------------------


def canonical_json(card: ModelCard) -> str:
    """The card as the hash sees it: every field but the model file's own ``sha256``, keys sorted, compact."""
    body = card.as_dict()
    body.pop("sha256")
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def card_sha256(card: ModelCard) -> str:
    """The card's own fingerprint, recorded in the ONNX metadata at export (``METADATA_CARD_SHA256``)."""
    return hashlib.sha256(canonical_json(card).encode()).hexdigest()


def _differences(mine: dict, embedded: dict, prefix: str = "") -> list[str]:
    """'field': card X, model Y for each field where the sidecar and the embedded card differ."""
    out = []
    for key in sorted(set(mine) | set(embedded)):
        a, b = mine.get(key), embedded.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key in ("input", "tiles"):
            out += _differences(a, b, f"{prefix}{key}.")
        elif json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            out.append(f"'{prefix}{key}': card {a!r}, model {b!r}")
    return out


def check_card_against_graph(card: ModelCard, metadata: dict[str, str], card_where: str, model_where: str) -> str:
    """Refuse a card that is not the one export embedded in the graph; return a warning ('' when none).

    ``metadata`` is the graph's ONNX metadata (onnxruntime's ``custom_metadata_map``)."""
    recorded, embedded_json = metadata.get(METADATA_CARD_SHA256), metadata.get(METADATA_CARD)
    try:
        embedded = json.loads(embedded_json) if embedded_json else None
    except ValueError:
        embedded = None
    if recorded is None and not isinstance(embedded, dict):
        return (
            f"{model_where} carries no embedded model card: {card_where} is checked against the schema and the "
            "graph's shapes, but an edit to it cannot be detected (export with the export stage to bind them)"
        )
    digest = card_sha256(card)
    if recorded is not None and recorded == digest:
        return ""
    diff = _differences(json.loads(canonical_json(card)), embedded) if isinstance(embedded, dict) else []
    if recorded is None and not diff:
        return (
            f"{model_where} was exported before the card's own sha256 was recorded; {card_where} matches the card "
            "embedded in the model field by field (re-export to record the hash)"
        )
    detail = f" (fields that differ: {'; '.join(diff)})" if diff else ""
    raise CardError(
        f"{card_where}: the card is not the one export recorded in {model_where}: its sha256 {digest[:12]}... "
        f"differs from the model's {(recorded or '(none)')[:12]}...{detail}. The card was edited or belongs to "
        "another export: restore it or export again"
    )


# --- files ------------------------------------------------------------------------------------------------


def read_regular_file(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of a regular file, read once. A FIFO, socket or device is refused without reading (opened
    non-blocking, so a FIFO with no writer cannot hang the caller); a file over ``limit`` bytes too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file ({file_kind(st.st_mode)})")
        if limit is not None and st.st_size > limit:
            raise OSError(f"{path}: {st.st_size} bytes, more than the {limit} expected")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """'a FIFO (named pipe)', 'a socket', ... for a stat mode: what a result line says was skipped."""
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def card_path_for(model_path: str | Path) -> Path:
    """``models/export/model.onnx`` -> ``models/export/model.card.json``."""
    p = Path(model_path)
    return p.with_name(p.stem + ".card.json")
