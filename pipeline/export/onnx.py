"""Export: one ONNX graph from uint8 pixels to decision inputs, its model card, and a parity check.

The graph takes (N, S, S, C) uint8 images (NHWC, dynamic N) and returns ``probs`` (N, K) and
``defect_score`` (N,); normalization is inside (``pipeline.model.DefectNet``). Parity: the exported
model, run by the edge runner itself, must give the same class probabilities as PyTorch on the real
test images, within ``export.max_abs_diff``; otherwise the export is broken and the stage fails.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx
import torch

from pipeline.config import StageError
from pipeline.model import DefectNet, ExportHead
from serving.card import METADATA_CARD, METADATA_CARD_SHA256, ModelCard, card_sha256

log = logging.getLogger(__name__)


class ParityError(StageError):
    """The exported model scores differently from the trained one."""


def export_onnx(
    net: DefectNet, ok_index: int, size: int, channels: int, opset: int, path: Path, card: ModelCard
) -> None:
    head = ExportHead(net, ok_index).eval()
    dummy = torch.zeros(2, size, size, channels, dtype=torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        head,
        (dummy,),
        str(path),
        input_names=["image"],
        output_names=["probs", "defect_score"],
        dynamic_axes={"image": {0: "batch"}, "probs": {0: "batch"}, "defect_score": {0: "batch"}},
        opset_version=opset,
        dynamo=False,
    )
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)  # full_check runs strict shape inference too
    set_card_metadata(model, card)
    onnx.save(model, str(path))


def set_card_metadata(model: onnx.ModelProto, card: ModelCard) -> None:
    """Embed ``card`` in the graph's metadata: the card (less the file's own sha256, which a file cannot carry)
    and the sha256 of its canonical JSON, which the runner compares with the sidecar's (serving.card)."""
    meta = json.loads(card.to_json())
    meta.pop("sha256")
    for prop in list(model.metadata_props):
        if prop.key in (METADATA_CARD, METADATA_CARD_SHA256):
            model.metadata_props.remove(prop)
    onnx.helper.set_model_props(
        model, {METADATA_CARD: json.dumps(meta, sort_keys=True), METADATA_CARD_SHA256: card_sha256(card)}
    )
