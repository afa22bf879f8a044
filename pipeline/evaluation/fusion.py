"""A model with tiles judged as the runner decides: the whole-image model's probabilities and each
photograph's most suspicious tile, fused (``serving.tiles.fuse``); each view alone is judged too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from pipeline.data.tiling import score_tiles
from pipeline.metrics import softmax
from pipeline.model import predict_logits
from pipeline.runtime import Runtime
from serving.tiles import image_probs

# the figures of each view alone that metrics.json carries beside the fused ones (whole_*, tiles_*)
VIEW_KEYS = ("defect_recall", "false_alarm_rate", "roc_auc", "accuracy")  # each view at its own card threshold


def tile_view(
    net: nn.Module, paths: list[str], images_dir: Path, tile: int, channels: int, ok_index: int, rt: Runtime
) -> np.ndarray:
    """(N, K): the tile model's probabilities of each photograph at ``paths``, those of its most suspicious
    tile (``serving.tiles.image_probs``)."""
    x, parent = score_tiles(paths, images_dir, tile, channels)
    return image_probs(softmax(predict_logits(net, x, rt)), parent, len(paths), ok_index)
