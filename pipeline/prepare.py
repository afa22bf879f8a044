"""Prepare: leakage-free stratified split and a packed, pre-resized store of the model inputs.

The split of an image follows from its near-duplicate group's hash, not from its position in a list:
adding new images never moves an existing image to another split (so the test set does not churn
between retrains), and near-duplicates never straddle train/val/test.
Each split is one ``.npz`` of (N, S, S, C) uint8 images resized by ``serving.preprocess.load_image``
(the one decode+resize implementation), so an epoch never re-decodes a JPEG, with their labels, paths
and near-duplicate groups.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.config import PrepareConfig
from serving.preprocess import load_image

log = logging.getLogger(__name__)
SPLITS = ("train", "val", "test")


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
    ok_class: str,
    channels: int,
    cfg: PrepareConfig,
    out_dir: Path,
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = assign_splits(manifest, cfg)
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

        def load(r: dict) -> np.ndarray:
            return load_image(images_dir / r["path"], cfg.image_size, channels, cfg.resize)

        # Pillow releases the GIL while decoding and resizing, so threads use both cores.
        with ThreadPoolExecutor(max_workers=2) as pool:
            images = list(tqdm(pool.map(load, rows), total=len(rows), desc=f"prepare {name}", unit="img"))
        x = np.stack(images) if images else np.zeros((0, cfg.image_size, cfg.image_size, channels), np.uint8)
        y = np.array([classes.index(r["label"]) for r in rows], dtype=np.int64)
        paths, groups = np.array([r["path"] for r in rows]), np.array([r["group"] for r in rows])
        np.savez(out_dir / f"{name}.npz", images=x, labels=y, paths=paths, groups=groups)
        summary["splits"][name] = {c: int((y == i).sum()) for i, c in enumerate(classes)}
    (out_dir / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def load_split(prepared_dir: Path, name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(N, S, S, C) uint8 images, (N,) int64 labels and relative paths of one split."""
    with np.load(prepared_dir / f"{name}.npz") as z:
        return z["images"], z["labels"], [str(p) for p in z["paths"]]


def load_groups(prepared_dir: Path, name: str) -> np.ndarray:
    """(N,) near-duplicate group of each image of a split (one physical part photographed several times),
    for ``pipeline.metrics.group_weights``."""
    with np.load(prepared_dir / f"{name}.npz") as z:
        return z["groups"]


def read_summary(prepared_dir: Path) -> dict:
    return json.loads((prepared_dir / "prepare.json").read_text())
