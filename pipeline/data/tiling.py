"""The tile model's data: every photograph cut at 1:1 into tiles of the model's input side
(``serving.tiles``), the training tiles labeled by the defect masks.

- A training tile is a defect of its image's class where the mask covers at least ``min_pixels`` of it, OK
  where it covers none (every tile of an OK image, the clean tiles of a defect image); tiles in between, and
  every tile of a defect image without a mask, are left out (where its defect is, is not known).
- The prepare stage writes the labeled train and val tiles to ``data/prepared/tiles`` (a prepared folder the
  train stage reads like the whole images'); the evaluate and export stages cut the val and test photographs
  again (``score_tiles``, a few seconds) and score every tile (``pipeline.evaluation.fusion``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from pipeline.data.masks import MASK_UNKNOWN, mask_path, read_mask
from pipeline.data.prepare import read_summary
from serving.preprocess import decode_image
from serving.tiles import cut_tiles, tile_count

log = logging.getLogger(__name__)
KEYS = ("images", "labels", "paths", "groups")


def tile_labels(
    mask: np.ndarray | None, label: int, ok_index: int, positions: list[tuple[int, int]], tile: int, min_pixels: int
) -> list[int | None]:
    """The training label of each tile at ``positions``: ``label`` where ``mask`` (H, W bool) covers at least
    ``min_pixels`` of it, ``ok_index`` where it covers none, None (left out) in between; an OK image's tiles
    are all OK, a defect image without a mask has every tile left out."""
    if label == ok_index:
        return [ok_index] * len(positions)
    if mask is None:
        return [None] * len(positions)
    covered = [int(mask[y : y + tile, x : x + tile].sum()) for x, y in positions]
    return [label if a >= min_pixels else ok_index if a == 0 else None for a in covered]


def tile_split(
    split: dict,
    images_dir: Path,
    masks_dir: Path | None,
    tile: int,
    channels: int,
    ok_index: int,
    min_pixels: int,
    transform=None,
    desc: str = "tiles",
) -> dict[str, np.ndarray]:
    """Every tile of a split's photographs (``split``: paths, labels, groups): images, labels (the mask's; -1
    left out), parent (the photograph's index), paths (``<path>#x,y``) and groups (the photograph's).
    ``transform(image, mask) -> (image, mask)`` is applied before cutting (an experiment's rescale)."""
    out: dict[str, list] = {"images": [], "labels": [], "parent": [], "paths": [], "groups": []}
    rows = zip(split["paths"], split["labels"], split["groups"], strict=True)
    for i, (rel, label, group) in enumerate(tqdm(list(rows), desc=desc, unit="img", mininterval=5)):
        rel = str(rel)
        image = decode_image(images_dir / rel, channels)
        mask = read_mask(masks_dir, rel) if masks_dir is not None and label != ok_index else None
        if mask is not None and mask.shape != image.shape[:2]:
            raise ValueError(
                f"{mask_path(masks_dir, rel)}: mask is {mask.shape[1]}x{mask.shape[0]} px, its image "
                f"{image.shape[1]}x{image.shape[0]}; expected the same size"
            )
        if transform is not None:
            image, mask = transform(image, mask)
        pieces = cut_tiles(image, tile)
        labels = tile_labels(mask, int(label), ok_index, [(x, y) for x, y, _ in pieces], tile, min_pixels)
        for (x, y, t), lab in zip(pieces, labels, strict=True):
            out["images"].append(t)
            out["labels"].append(-1 if lab is None else lab)
            out["parent"].append(i)
            out["paths"].append(f"{rel}#{x},{y}")
            out["groups"].append(group)
    if not out["images"]:
        return {
            k: np.zeros((0, tile, tile, channels), np.uint8) if k == "images" else np.array(v) for k, v in out.items()
        }
    return {k: np.array(v) for k, v in out.items()}


def write_tile_data(dest: Path, info: dict, train_tiles: dict, val_tiles: dict) -> Path:
    """A prepared folder the train stage reads: the labeled training tiles and the labeled val tiles (the
    training's val figures are then by tile). Written once for the same tiles and labels: its bytes are the
    training's fingerprint, so a killed run resumes instead of starting over."""
    marker = dest / "tiles.sha256"
    digest = hashlib.sha256(json.dumps(info, sort_keys=True).encode())  # tile size and channels among it
    for d in (train_tiles, val_tiles):
        digest.update("\n".join(f"{p} {y}" for p, y in zip(d["paths"], d["labels"], strict=True)).encode())
        digest.update(np.ascontiguousarray(d["images"]).data)  # the pixels: other images at the same paths
    if marker.is_file() and marker.read_text() == digest.hexdigest():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    info = dict(info, splits={})
    for name, d in (("train", train_tiles), ("val", val_tiles)):  # the train stage reads no test split
        keep = d["labels"] >= 0
        arrays = {k: d[k][keep] for k in KEYS}
        arrays["masks"] = np.full((int(keep.sum()), 1, 1), MASK_UNKNOWN, np.uint8)  # no mask head for tiles
        np.savez(dest / f"{name}.npz", **arrays)
        info["splits"][name] = {c: int((arrays["labels"] == i).sum()) for i, c in enumerate(info["classes"])}
    (dest / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    marker.write_text(digest.hexdigest())
    return dest


def prepare_tiles(prepared_dir: Path, images_dir: Path, masks_dir: Path, min_pixels: int) -> dict | None:
    """The prepare stage's tile data, ``prepared_dir/tiles``, from its train and val splits; None (and no
    folder) where no training tile is covered by a mask: nothing to learn defects from."""
    info = read_summary(prepared_dir)
    ok_index, tile = info["classes"].index(info["ok_class"]), info["image_size"]
    tiles = {}
    for name in ("train", "val"):
        with np.load(prepared_dir / f"{name}.npz") as z:
            split = {k: z[k] for k in ("paths", "labels", "groups")}
        tiles[name] = tile_split(
            split, images_dir, masks_dir, tile, info["channels"], ok_index, min_pixels, desc=f"tiles {name}"
        )
    tr = tiles["train"]["labels"]
    counts = {
        "defect": int(((tr >= 0) & (tr != ok_index)).sum()),
        "ok": int((tr == ok_index).sum()),
        "left_out": int((tr < 0).sum()),
    }
    if not counts["defect"]:
        log.warning("%s: no training tile is covered by a defect mask (>= %d px): no tile model", masks_dir, min_pixels)
        return None
    same = {k: v for k, v in info.items() if k not in ("splits", "masks_known", "tiles")}  # classes, size, ...
    write_tile_data(prepared_dir / "tiles", same | {"min_mask_pixels": min_pixels}, tiles["train"], tiles["val"])
    per_image = len(tr) / max(1, len(np.unique(tiles["train"]["parent"])))
    return {"tile": tile, "train_tiles": counts, "tiles_per_image": per_image}


def tiles_per_photograph(prepared_dir: Path, images_dir: Path, sample: int = 64) -> float:
    """The median number of tiles a training photograph is cut into, from the headers of up to ``sample``."""
    info = read_summary(prepared_dir)
    with np.load(prepared_dir / "train.npz") as z:
        paths = list(z["paths"][:: max(1, len(z["paths"]) // sample)])
    counts = []
    for rel in paths:
        with Image.open(images_dir / str(rel)) as im:
            counts.append(tile_count(im.height, im.width, info["image_size"]))
    return float(np.median(counts)) if counts else 0.0


def tile_data(
    use: str, prepared_dir: Path, images_dir: Path, masks_dir: Path, min_pixels: int
) -> tuple[dict | None, str]:
    """The prepare stage's step for ``tiles.use``: auto cuts ``prepared_dir/tiles`` where the data has defect
    masks and the photographs are at least two tiles (``prepare_tiles``): (the tile data, or None for the
    whole images alone, and why in words)."""
    shutil.rmtree(prepared_dir / "tiles", ignore_errors=True)
    if use != "auto":
        return None, "tiles.use off"
    if read_summary(prepared_dir)["ok_class"] is None:
        return None, "tiles.use auto: no OK class (defect-type sorting): a tile without the defect has no label"
    if not masks_dir.is_dir() or not any(masks_dir.rglob("*.png")):
        return None, "tiles.use auto: the data has no defect masks"
    per_photo = tiles_per_photograph(prepared_dir, images_dir)
    if per_photo < 2:
        return None, "tiles.use auto: the photographs are one tile each (the whole-image model sees them 1:1)"
    cut = prepare_tiles(prepared_dir, images_dir, masks_dir, min_pixels)
    if cut is None:
        return None, "tiles.use auto: no defect mask covers a training tile"
    return cut, f"tiles.use auto: the data has defect masks ({cut['train_tiles']['defect']} defect training tiles)"


def score_tiles(paths: list[str], images_dir: Path, tile: int, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Every tile of the photographs at ``paths`` (relative to ``images_dir``): (T, tile, tile, C) uint8 and
    each tile's photograph index, for scoring."""
    split = {"paths": np.array(paths), "labels": np.zeros(len(paths), int), "groups": np.array(paths)}
    t = tile_split(split, images_dir, None, tile, channels, 0, 1, desc="cut tiles")
    return t["images"], t["parent"]
