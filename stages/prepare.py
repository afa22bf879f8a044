"""Stage prepare: validated manifest -> leakage-free split, resized and packed (data/prepared); where the data
has defect masks (and ``tiles.use`` is auto), also the tile model's training tiles (data/prepared/tiles)."""

import dataclasses
import json
from pathlib import Path

from pipeline.config import NO_OK_CLASS
from pipeline.data.prepare import auto_image_size, prepare
from pipeline.data.tiling import tile_data
from pipeline.data.validate import read_manifest
from pipeline.entry import run_stage

OUT, IMAGES, MASKS = Path("data/prepared"), Path("data/raw/images"), Path("data/raw/masks")


def main(params):
    manifest = read_manifest(Path("data/validated/manifest.csv"))
    classes = sorted({r["label"] for r in manifest})
    ok_class = None if params.data.ok_class == NO_OK_CLASS else params.data.ok_class  # None: defect-type sorting
    cfg, size_reason = params.prepare, f"prepare.image_size {params.prepare.image_size} px"
    if cfg.image_size == "auto":
        size, size_reason = auto_image_size(manifest)
        cfg = dataclasses.replace(cfg, image_size=size)
    print(f"prepare: {size_reason}")
    summary = prepare(manifest, IMAGES, classes, ok_class, params.data.channels, cfg, OUT, masks_dir=MASKS)
    summary["image_size_reason"] = size_reason
    # None: the whole images alone (tiles.use off, no masks, one tile per photograph, or no tile covered by one)
    summary["tiles"], summary["tiles_reason"] = tile_data(
        params.tiles.use, OUT, IMAGES, MASKS, params.tiles.min_mask_pixels
    )
    (OUT / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"prepare: {summary['splits']}; {summary['tiles_reason']}")


if __name__ == "__main__":
    run_stage("prepare", main)
