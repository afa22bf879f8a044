"""Prepare: leakage-free stratified split and a packed, pre-resized store of the model inputs.

The split of an image follows from its near-duplicate group's hash, not from its position in a list:
adding new images never moves an existing image to another split (so the test set does not churn
between retrains), and near-duplicates never straddle train/val/test.
Each split is one ``.npz`` of (N, S, S, C) uint8 images resized by ``serving.preprocess.load_image``
(the one decode+resize implementation), so an epoch never re-decodes a JPEG, with their labels, paths,
near-duplicate groups and defect masks (``masks``: (N, S, S) uint8 brought to the input exactly as
the image was; see ``mask_for``).
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from pipeline.config import PrepareConfig
from pipeline.data.masks import MASK_UNKNOWN, mask_path
from serving.preprocess import load_image, resize_image

log = logging.getLogger(__name__)
SPLITS = ("train", "val", "test")


def load_mask(masks_dir: Path, rel_path: str, size: int, resize: str) -> np.ndarray | None:
    """The mask of image ``rel_path`` (``<class>/<name>.*`` -> ``masks_dir/<class>/<name>.png``), brought to
    the model input exactly as the image was (same letterbox or squash); None when absent or empty."""
    path = mask_path(masks_dir, rel_path)
    if not path.is_file():
        return None
    m = np.asarray(Image.open(path).convert("L"), dtype=np.uint8)
    if not m.any():
        return None
    # Same geometry as the image; the letterbox padding is no defect.
    m = resize_image((m > 127).astype(np.uint8)[:, :, None] * 255, size, resize, fill=0)[:, :, 0]
    return m > 127


def mask_for(masks_dir: Path | None, row: dict, ok_class: str | None, size: int, resize: str) -> np.ndarray:
    """(S, S) uint8 training target: 1 on the defect, 0 elsewhere; all 0 for an OK image (nothing to
    find there); all ``MASK_UNKNOWN`` for a defect image without a usable mask (a missing or empty file,
    or a defect too small to survive the resize: a defect image is never "all clear"), which the mask
    loss then skips. ``masks_dir`` None: the dataset has no masks; every mask unknown."""
    if masks_dir is None:
        return np.full((size, size), MASK_UNKNOWN, np.uint8)
    if row["label"] == ok_class:
        return np.zeros((size, size), np.uint8)
    m = load_mask(masks_dir, row["path"], size, resize)
    return np.full((size, size), MASK_UNKNOWN, np.uint8) if m is None or not m.any() else m.astype(np.uint8)


def split_of(group: str, cfg: PrepareConfig) -> str:
    """Map a group hash to a split: the first 8 hex digits as a uniform number in [0, 1)."""
    u = int(group[:8], 16) / 16**8
    if u < cfg.split.test:
        return "test"
    if u < cfg.split.test + cfg.split.val:
        return "val"
    return "train"


def assign_splits(rows: list[dict], cfg: PrepareConfig) -> dict[str, list[dict]]:
    """Group-hash split, then make sure every class has at least one image in val and in test.

    A tiny class can get no val or test image by chance; then its train groups with the lowest hash are
    moved (deterministic, and stable while the class stays small).
    """
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for r in rows:
        out[split_of(r["group"], cfg)].append(r)
    for label in sorted({r["label"] for r in rows}):
        for split in ("test", "val"):
            if any(r["label"] == label for r in out[split]):
                continue
            train_groups = sorted({r["group"] for r in out["train"] if r["label"] == label})
            if len(train_groups) < 2:
                log.warning("class %s has too few images to place one in %s", label, split)
                continue
            moved = [r for r in out["train"] if r["group"] == train_groups[0]]
            out["train"] = [r for r in out["train"] if r["group"] != train_groups[0]]
            out[split] += moved
    return out


def prepare(
    manifest: list[dict],
    images_dir: Path,
    classes: list[str],
    ok_class: str | None,
    channels: int,
    cfg: PrepareConfig,
    out_dir: Path,
    masks_dir: Path | None = None,
) -> dict:
    """``ok_class`` None: defect-type sorting, every class a defect type. ``masks_dir``: the defect masks (``<class>/<stem>.png``, as ingest lays them out), if any; without a
    single defect mask there, no mask is known, OK images' included (nothing would teach where defects are)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = assign_splits(manifest, cfg)
    has_masks = masks_dir is not None and any(
        (masks_dir / Path(r["path"]).parent / f"{Path(r['path']).stem}.png").is_file()
        for r in manifest
        if r["label"] != ok_class
    )
    summary: dict = {
        "classes": classes,
        "ok_class": ok_class,
        "image_size": cfg.image_size,
        "channels": channels,
        "resize": cfg.resize,
        "splits": {},
    }
    for name in SPLITS:
        rows = sorted(splits[name], key=lambda r: r["path"])

        def load(r: dict) -> tuple[np.ndarray, np.ndarray]:
            s = cfg.image_size
            image = load_image(images_dir / r["path"], s, channels, cfg.resize)
            return image, mask_for(masks_dir if has_masks else None, r, ok_class, s, cfg.resize)

        # Pillow releases the GIL while decoding and resizing, so threads use both cores.
        with ThreadPoolExecutor(max_workers=2) as pool:
            loaded = list(tqdm(pool.map(load, rows), total=len(rows), desc=f"prepare {name}", unit="img"))
        s = cfg.image_size
        x = np.stack([i for i, _ in loaded]) if loaded else np.zeros((0, s, s, channels), np.uint8)
        masks = np.stack([m for _, m in loaded]) if loaded else np.zeros((0, s, s), np.uint8)
        y = np.array([classes.index(r["label"]) for r in rows], dtype=np.int64)
        paths, groups = np.array([r["path"] for r in rows]), np.array([r["group"] for r in rows])
        np.savez(out_dir / f"{name}.npz", images=x, labels=y, paths=paths, groups=groups, masks=masks)
        summary["splits"][name] = {c: int((y == i).sum()) for i, c in enumerate(classes)}
        known = int((masks != MASK_UNKNOWN).any(axis=(1, 2)).sum())
        summary.setdefault("masks_known", {})[name] = known
    (out_dir / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_split(prepared_dir: Path, name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(N, S, S, C) uint8 images, (N,) int64 labels and relative paths of one split."""
    with np.load(prepared_dir / f"{name}.npz") as z:
        return z["images"], z["labels"], [str(p) for p in z["paths"]]


def load_masks(prepared_dir: Path, name: str) -> np.ndarray | None:
    """(N, S, S) uint8 masks of a split (``mask_for``), or None for data prepared before masks were kept."""
    with np.load(prepared_dir / f"{name}.npz") as z:
        return z["masks"] if "masks" in z.files else None


def load_groups(prepared_dir: Path, name: str) -> np.ndarray:
    """(N,) near-duplicate group of each image of a split (one physical part photographed several times),
    for ``pipeline.metrics.group_weights``."""
    with np.load(prepared_dir / f"{name}.npz") as z:
        return z["groups"]


# The input sides prepare.image_size auto picks from. Above 192 px a b0 trains a thousand images for more than
# 15 minutes on 2 CPU cores; larger photographs with masks are seen at full resolution by the tile model.
AUTO_SIZE_RANGE = (64, 192)


def auto_image_size(manifest: list[dict]) -> tuple[int, str]:
    """``prepare.image_size: auto``: the images' median shorter side, rounded down to a multiple of 32 (the
    network's coarsest stride) within ``AUTO_SIZE_RANGE``: the model sees the defects at about the resolution
    they were photographed at, and no larger. (input side, why in words)."""
    median = float(np.median([min(int(r["width"]), int(r["height"])) for r in manifest]))
    low, high = AUTO_SIZE_RANGE
    size = int(min(max(median // 32 * 32, low), high))
    return size, f"prepare.image_size auto: {size} px (the images' median shorter side is {median:.0f} px)"


def read_summary(prepared_dir: Path) -> dict:
    return json.loads((prepared_dir / "prepare.json").read_text())


def ok_index(info: dict) -> int | None:
    """The OK class's index in ``info["classes"]`` (prepare.json, a model's meta), None for defect-type
    sorting (``data.ok_class: none``: prepare writes ``ok_class: null``)."""
    return None if info["ok_class"] is None else info["classes"].index(info["ok_class"])
