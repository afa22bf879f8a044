"""Tiles: a photograph cut at 1:1 into squares of the model's input side, and the fusion of a tile model's
scores with the whole-image model's. Shared by the prepare stage (training tiles), the evaluate and export
stages and the runner, so a photograph is cut and scored the same way everywhere.

A thin crack 2 px wide in a 600 px photograph is under half a pixel after the whole image's resize to
128 px; in a 128 px tile cut at 1:1 it stays 2 px wide. The tile model scores every tile; an image's tile
view is its tile with the highest defect score, and the fused probabilities are
``(1 - weight) * whole + weight * tile view`` (measured on the magnetic tiles: docs/training.md, *The tile model*).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

TILE_GRAPH_SUFFIX = ".tiles.onnx"


def spans(length: int, tile: int) -> list[int]:
    """Start offsets of tiles of side ``tile`` covering ``length`` pixels: evenly spread, the first at 0 and
    the last flush with the end (neighbours overlap by what the cover needs); [0] for a shorter side."""
    if length <= tile:
        return [0]
    k = math.ceil(length / tile)
    return [round(i * (length - tile) / (k - 1)) for i in range(k)]


def pad_to(crop: np.ndarray, tile: int) -> np.ndarray:
    """``crop`` centred on a ``tile`` square filled with its mean colour (the letterbox's padding), never
    scaled."""
    h, w, c = crop.shape
    if (h, w) == (tile, tile):
        return crop
    out = np.empty((tile, tile, c), np.uint8)
    out[:] = crop.reshape(-1, c).mean(axis=0).round().astype(np.uint8)
    top, left = (tile - h) // 2, (tile - w) // 2
    out[top : top + h, left : left + w] = crop
    return out


def cut_tiles(image: np.ndarray, tile: int) -> list[tuple[int, int, np.ndarray]]:
    """(x, y, tile image) for every tile of an (H, W, C) image, each (tile, tile, C) uint8 at 1:1; a side
    shorter than ``tile`` is padded (``pad_to``)."""
    h, w = image.shape[:2]
    out = []
    for y in spans(h, tile):
        for x in spans(w, tile):
            out.append((x, y, pad_to(image[y : y + tile, x : x + tile], tile)))
    return out


def tile_batch(images: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, H, W, C) images -> every image's tiles stacked, (T, tile, tile, C), and each tile's image (0..N-1):
    what a tile model scores and ``image_probs`` gathers back."""
    tiles = np.stack([t for img in images for _, _, t in cut_tiles(img, tile)])
    return tiles, np.repeat(np.arange(len(images)), tile_count(*images.shape[1:3], tile))


def tile_count(height: int, width: int, tile: int) -> int:
    """How many tiles ``cut_tiles`` gives for an image of this size: arithmetic only, so a declared size of
    any magnitude (a header's 2^31 px strip) is counted without a list of its offsets."""
    return max(1, math.ceil(height / tile)) * max(1, math.ceil(width / tile))


def max_tiles(max_pixels: int, tile: int) -> int:
    """The tile budget of ``max_pixels``: the tiles of the largest square photograph within it. A long thin
    image has few pixels but many tiles (each padded to a full square): this is the limit it meets."""
    side = math.isqrt(max_pixels)
    return tile_count(side, side, tile)


def tile_chunks(images: np.ndarray, tile: int, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``tile_batch`` in runs: (each tile's image index (t,), tiles (t, tile, tile, C) uint8), t <= ``chunk``,
    cut as they are needed, so at most one run of tiles is in memory whatever the photographs' sizes."""
    parent: list[int] = []
    cut: list[np.ndarray] = []
    for i, img in enumerate(images):
        h, w = img.shape[:2]
        for y in spans(h, tile):
            for x in spans(w, tile):
                parent.append(i)
                cut.append(pad_to(img[y : y + tile, x : x + tile], tile))
                if len(cut) == chunk:
                    yield np.array(parent), np.stack(cut)
                    parent, cut = [], []
    if cut:
        yield np.array(parent), np.stack(cut)


class TileView:
    """``image_probs`` gathered run by run: each image's probabilities are those of its tile with the
    highest defect score (1 - p(ok)) among the runs added so far; ties keep the first tile, as there."""

    def __init__(self, n: int, classes: int, ok_index: int) -> None:
        self.ok_index = ok_index
        self.best = np.zeros((n, classes), np.float32)  # (n, K)
        self.score = np.full(n, -np.inf)  # (n,) the best tile's defect score so far
        self.seen = np.zeros(n, bool)

    def add(self, parent: np.ndarray, tile_probs: np.ndarray) -> None:
        """One run: ``tile_probs`` (t, K) of tiles whose images are ``parent`` (t,)."""
        score = 1 - tile_probs[:, self.ok_index]
        order = np.lexsort((-score, parent))  # by image, the most suspicious tile first
        first = order[np.r_[True, parent[order][1:] != parent[order][:-1]]]
        img = parent[first]
        better = ~self.seen[img] | (score[first] > self.score[img])
        self.best[img[better]] = tile_probs[first[better]]
        self.score[img[better]] = score[first[better]]
        self.seen[img] = True

    def probs(self) -> np.ndarray:
        if not self.seen.all():
            raise ValueError(f"{int((~self.seen).sum())} images have no tile")
        return self.best


def image_probs(tile_probs: np.ndarray, parent: np.ndarray, n: int, ok_index: int) -> np.ndarray:
    """(n, K): each image's probabilities are those of its tile with the highest defect score (1 - p(ok));
    ``parent`` gives each tile's image (0..n-1)."""
    parent = np.asarray(parent)
    if len(parent) != len(tile_probs):
        raise ValueError(f"{len(tile_probs)} tile scores for {len(parent)} tiles")
    if len(parent) and (parent.min() < 0 or parent.max() >= n):
        raise ValueError(f"a tile's image index is outside 0..{n - 1}")
    if len(np.unique(parent)) != n:
        raise ValueError(f"{n - len(np.unique(parent))} images have no tile")
    score = 1 - tile_probs[:, ok_index]
    order = np.lexsort((-score, parent))  # by image, the most suspicious tile first
    first = np.r_[True, parent[order][1:] != parent[order][:-1]]
    out = np.zeros((n, tile_probs.shape[1]), np.float32)
    out[parent[order][first]] = tile_probs[order][first]
    return out


def fuse(whole: np.ndarray, tiles: np.ndarray, weight: float) -> np.ndarray:
    """(N, K) probabilities of the whole-image model and of each image's most suspicious tile -> the fused
    (N, K) probabilities (a weighted mean: still a distribution)."""
    return ((1 - weight) * whole + weight * tiles).astype(np.float32)


def tile_graph_path(model_path: str | Path) -> Path:
    """``models/export/model.fp16.onnx`` -> ``model.fp16.tiles.onnx``: where export writes a variant's tile
    graph, beside its whole-image graph (the card names it as ``tiles.model``)."""
    p = Path(model_path)
    return p.with_name(p.stem + TILE_GRAPH_SUFFIX)


def is_tile_graph(path: str | Path) -> bool:
    """A file named like ``tile_graph_path``'s output (a registry version holds it beside the whole graph)."""
    return Path(path).name.endswith(TILE_GRAPH_SUFFIX)
