"""The PyTorch reference scorer: what the exported graphs must match (export's parity gate) and what the
runner is timed against (the benchmark stage and ``make bench``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from serving.preprocess import resize_image
from serving.tiles import fuse, image_probs, tile_batch


def torch_scorer(net, tile_net, card) -> Callable[[np.ndarray], np.ndarray]:
    """PyTorch eager scoring what the runner with ``card`` scores: (N, S, S, C) model inputs, or with tiles
    (N, H, W, C) photographs (the whole view resized and the 1:1 tiles, fused), so timings compare like
    with like. ``net``/``tile_net``: the trained networks (or their ``torch.compile``d forms)."""

    def score(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            if not card.tiles:
                return net(torch.from_numpy(batch)).softmax(1).numpy()
            whole = np.stack([resize_image(p, card.input.size, card.input.resize) for p in batch])
            tiles, parent = tile_batch(batch, card.tiles.size)
            whole_probs = net(torch.from_numpy(whole)).softmax(1).numpy()
            tile_probs = tile_net(torch.from_numpy(tiles)).softmax(1).numpy()
            return fuse(whole_probs, image_probs(tile_probs, parent, len(batch), card.ok_index), card.tiles.weight)

    return score
