"""The model card: everything the runner needs to know about an exported model, and nothing guessed.

Export writes it twice: as a sidecar JSON next to the ONNX file (``<model>.card.json``, with the
file's sha256) and inside the ONNX metadata (``model_card``, without the sha256, which cannot hash
the file that contains it). The runner reads the sidecar, checks the sha256, and trusts nothing else.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CARD_VERSION = 1


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
    ok_class: str
    input: InputSpec
    threshold: float  # defect_score >= threshold -> "defect"
    variant: str = "fp32"
    deployable: bool = True
    not_deployable_reason: str = ""
    sha256: str = ""
    training_run_id: str = ""
    data_fingerprint: str = ""
    parity: dict[str, Any] = field(default_factory=dict)
    recommended: dict[str, str] = field(default_factory=dict)  # execution provider -> variant to run there
    outputs: dict[str, str] = field(
        default_factory=lambda: {"probs": "(N, K) float32 class probabilities", "defect_score": "(N,) 1 - p(ok)"}
    )
    tiles: TileSpec | None = None  # None: the whole-image graph alone decides
    card_version: int = CARD_VERSION

    @property
    def ok_index(self) -> int:
        return self.classes.index(self.ok_class)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "model card") -> ModelCard:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise CardError(f"{where}: unknown field {unknown[0]!r}")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]  # type: ignore[misc]
        if missing:
            raise CardError(f"{where}: missing field {missing[0]!r}")
        if raw.get("card_version", CARD_VERSION) != CARD_VERSION:
            raise CardError(f"{where}: card_version {raw['card_version']} is not supported (expected {CARD_VERSION})")
        try:
            spec = InputSpec(**raw["input"])
        except TypeError as exc:
            raise CardError(f"{where}: field 'input': {exc}") from None
        tiles = raw.get("tiles")
        if tiles is not None:
            try:
                tiles = TileSpec(**tiles)
            except TypeError as exc:
                raise CardError(f"{where}: field 'tiles': {exc}") from None
            if not 0 < tiles.weight <= 1 or tiles.size < 1:
                raise CardError(f"{where}: tiles.weight must be in (0, 1] and tiles.size >= 1, got {tiles}")
        card = cls(**{**raw, "input": spec, "tiles": tiles})
        if card.ok_class not in card.classes:
            raise CardError(f"{where}: ok_class {card.ok_class!r} is not one of classes {card.classes}")
        if spec.channels not in (1, 3) or spec.resize not in ("letterbox", "squash"):
            raise CardError(f"{where}: input.channels must be 1 or 3 and input.resize letterbox or squash")
        return card

    @classmethod
    def read(cls, path: str | Path) -> ModelCard:
        path = Path(path)
        if not path.is_file():
            raise CardError(f"{path}: model card not found (export writes it beside the model)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CardError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(raw, str(path))

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")


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
