"""Where the model looks: Grad-CAM heatmaps (captum) and the pointing-game score against defect masks.

Grad-CAM weights a convolutional layer's feature maps by the gradient of one class logit and keeps the
positive part: the regions that raise that class. We take the deepest layer with stride 16 (8 x 8
cells at 128 px; the last layer's 4 x 4 is too coarse to point at a crack) and the image's *true*
class, so a defect image classified right for the wrong reason (the background, the padding, a
border) shows up as a miss. An ensemble's heatmap is the mean of its members' heatmaps, each for its
own logit of that class and scaled to [0, 1] first: every member has the same say, as in the mean of
their probabilities, and no member's gradient scale outweighs the others. Measured (README, *Heatmaps*),
it points as often as the best member alone, and more often than the ensemble's output at member 0's
layer (0.62 against 0.39 on the synthetic data).

Pointing game (Zhang et al., 2016): a hit when the heatmap's peak falls inside the defect mask,
dilated by ``tolerance`` pixels: 1/16 of the side, the benchmark's 15 pixels at 224 px scaled, and half
a cell of the stride-16 layer, which cannot place its peak more finely. Images whose mask is missing
or empty are not counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from captum.attr import LayerAttribution, LayerGradCam
from scipy.ndimage import binary_dilation
from torch import nn

from pipeline.data.prepare import load_mask
from pipeline.model import Ensemble, feature_layer
from pipeline.plots import plt
from serving.preprocess import resize_image
from serving.tiles import cut_tiles

log = logging.getLogger(__name__)


def cam_layer(net: nn.Module) -> nn.Module:
    """The deepest feature layer with stride <= 16 of one network's timm backbone (its ``feature_info``);
    an ensemble has one per member (``gradcam`` takes them in turn)."""
    return net.backbone.get_submodule(feature_layer(net.backbone)[0])


def gradcam(net: nn.Module, images: np.ndarray, targets: np.ndarray, batch_size: int = 16) -> np.ndarray:
    """(N, S, S, C) uint8 images, (N,) class indices -> (N, S, S) heatmaps scaled to [0, 1] per image."""
    if isinstance(net, Ensemble):
        return _unit(np.mean([gradcam(m, images, targets, batch_size) for m in net.members], axis=0))
    net = net.eval()
    cam = LayerGradCam(net, cam_layer(net))
    size = images.shape[1]
    out = []
    for i in range(0, len(images), batch_size):
        x = torch.from_numpy(images[i : i + batch_size]).float()
        t = torch.from_numpy(targets[i : i + batch_size]).long()
        attr = cam.attribute(x, target=t, relu_attributions=True)  # (n, 1, h, w) at the layer's resolution
        up = LayerAttribution.interpolate(attr, (size, size), interpolate_mode="bilinear")[:, 0]
        out.append(up.detach().numpy())
    return _unit(np.concatenate(out) if out else np.zeros((0, size, size), np.float32))


def _unit(maps: np.ndarray) -> np.ndarray:
    """Each map divided by its peak (all-zero maps stay zero)."""
    peak = maps.max(axis=(1, 2), keepdims=True)  # (0, 1, 1) for no images: fine
    return np.where(peak > 0, maps / np.maximum(peak, 1e-12), 0.0).astype(np.float32)


def pointing_game(maps: np.ndarray, masks: list[np.ndarray | None], tolerance: int) -> np.ndarray:
    """Per image: 1.0 hit, 0.0 miss, nan when there is no mask to point at."""
    result = np.full(len(maps), np.nan)
    for i, (m, mask) in enumerate(zip(maps, masks, strict=True)):
        if mask is None or not m.any():
            if mask is not None:
                result[i] = 0.0  # an all-zero heatmap points nowhere
            continue
        y, x = np.unravel_index(np.argmax(m), m.shape)
        grown = binary_dilation(mask, iterations=tolerance) if tolerance > 0 else mask
        result[i] = float(grown[y, x])
    return result


def heatmap_grid(
    images: np.ndarray,
    maps: np.ndarray,
    masks: list[np.ndarray | None],
    titles: list[str],
    rows: list[str],
    per_row: int,
    path: Path,
) -> None:
    """A PNG grid: one row per class, the image in gray, the heatmap over it, the mask outlined, the peak."""
    fig, axes = plt.subplots(len(rows), per_row, figsize=(2.0 * per_row, 2.15 * len(rows)), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for r, row in enumerate(rows):
        axes[r, 0].set_title(row, loc="left", fontsize=9, fontweight="bold")
    for k, (img, m, mask, title) in enumerate(zip(images, maps, masks, titles, strict=True)):
        r, c = divmod(k, per_row)
        ax = axes[r, c]
        if not title:  # a class with fewer test images than cells: leave the cell empty
            continue
        ax.imshow(img.mean(axis=2), cmap="gray", vmin=0, vmax=255)
        ax.imshow(m, cmap="jet", alpha=0.4, vmin=0, vmax=1)
        if mask is not None:
            ax.contour(mask, levels=[0.5], colors="white", linewidths=0.8)
        if m.any():
            y, x = np.unravel_index(np.argmax(m), m.shape)
            ax.plot(x, y, "w+", markersize=8, markeredgewidth=1.5)
        ax.text(2, img.shape[0] - 3, title, color="white", fontsize=6.5, backgroundcolor=(0, 0, 0, 0.55))
    fig.suptitle("Grad-CAM for the true class (white line: defect mask, +: heatmap peak)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def heatmap_report(
    net: nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    probs: np.ndarray,
    rel_paths: list[str],
    classes: list[str],
    ok_class: str | None,
    masks_dir: Path,
    resize: str,
    per_class: int,
    out_dir: Path,
    seed: int = 0,
    cams: Callable[[list[int]], np.ndarray] | None = None,
) -> dict:
    """Pointing game over every test defect image with a mask, and the grid of ``per_class`` images per
    class; returns the metrics (``pointing_game`` is nan when no test image has a mask). ``cams``: the
    heatmaps of the images at the given indices, (n, S, S) in the input's geometry (default: ``net``'s
    Grad-CAM; a model with tiles: ``tile_cams``)."""
    size = images.shape[1]
    ok = -1 if ok_class is None else classes.index(ok_class)  # None: defect-type sorting, every image a defect
    mask_of = {}  # test defect image index -> its mask, brought to the model input
    for i in np.nonzero(labels != ok)[0].tolist():
        mask = load_mask(masks_dir, rel_paths[i], size, resize)
        if mask is not None:
            mask_of[i] = mask

    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    rows = []
    for c, name in enumerate(classes):
        members = np.nonzero(labels == c)[0]
        if len(members):
            rows.append(name)
            pick = rng.choice(members, size=min(per_class, len(members)), replace=False)
            chosen.extend(sorted(pick.tolist()) + [-1] * (per_class - len(pick)))
    # One Grad-CAM pass over every image either the pointing game or the grid needs.
    need = sorted(set(mask_of) | {i for i in chosen if i >= 0})
    cams = cams or (lambda idx: gradcam(net, images[idx], labels[idx]))
    maps = dict(zip(need, cams(need), strict=True)) if need else {}

    metrics: dict = {"pointing_game_images": len(mask_of)}
    if mask_of:
        idx = np.array(sorted(mask_of))
        hits = pointing_game(np.stack([maps[i] for i in idx]), [mask_of[i] for i in idx], tolerance=max(1, size // 16))
        metrics["pointing_game"] = float(np.nanmean(hits))
        for c in sorted(set(labels[idx].tolist())):
            metrics[f"pointing_game_{classes[c]}"] = float(np.nanmean(hits[labels[idx] == c]))
    else:
        metrics["pointing_game"] = float("nan")
        log.info("no defect masks under %s for the test images: pointing game not measured", masks_dir)

    grid_imgs, grid_maps, grid_masks, titles = [], [], [], []
    for i in chosen:
        if i < 0:  # a class with fewer test images than per_class: an empty cell
            grid_imgs.append(np.zeros((size, size, images.shape[3]), np.uint8))
            grid_maps.append(np.zeros((size, size), np.float32))
            grid_masks.append(None)
            titles.append("")
            continue
        grid_imgs.append(images[i])
        grid_maps.append(maps[i])
        grid_masks.append(mask_of.get(i))
        k = int(probs[i].argmax())
        titles.append(f"pred {classes[k]} {probs[i, k] if ok < 0 else 1 - probs[i, ok]:.2f}")
    if rows:
        heatmap_grid(
            np.stack(grid_imgs), np.stack(grid_maps), grid_masks, titles, rows, per_class, out_dir / "heatmaps.png"
        )
    return metrics


def tile_cams(
    tile_net: nn.Module,
    photos: Callable[[int], np.ndarray],
    labels: np.ndarray,
    tile: int,
    ok_index: int,
    size: int,
    resize: str,
) -> Callable[[list[int]], np.ndarray]:
    """A model with tiles decides where the defect is by its most suspicious tile, so its heatmap is the tile
    model's Grad-CAM (the true class) over that tile, placed where the tile sits in the photograph (zero
    elsewhere) and brought to the input's geometry like the image (``resize_image``, padding zero).
    ``photos(i)``: image i at full resolution. On the synthetic data (one tile per image) it points at the
    defect far more often than the whole-image model's (README, *Heatmaps*)."""

    def cams(idx: list[int]) -> np.ndarray:
        out = []
        for i in idx:
            photo = photos(i)
            pieces = cut_tiles(photo, tile)
            stack = np.stack([t for _, _, t in pieces])
            with torch.no_grad():
                p_ok = tile_net.eval()(torch.from_numpy(stack)).softmax(1)[:, ok_index].numpy()
            k = int(np.argmin(p_ok))  # the most suspicious tile: the one the tile view takes
            x, y, _ = pieces[k]
            cam = gradcam(tile_net, stack[k : k + 1], labels[i : i + 1])[0]
            h, w = min(tile, photo.shape[0] - y), min(tile, photo.shape[1] - x)
            top, left = (tile - h) // 2, (tile - w) // 2  # a side shorter than the tile was padded (centred)
            full = np.zeros(photo.shape[:2], np.float32)
            full[y : y + h, x : x + w] = cam[top : top + h, left : left + w]
            scaled = resize_image((full * 255).round().astype(np.uint8)[:, :, None], size, resize, fill=0)
            out.append(scaled[:, :, 0].astype(np.float32) / 255)
        return _unit(np.stack(out)) if out else np.zeros((0, size, size), np.float32)

    return cams
