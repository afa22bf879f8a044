"""Stage prepare: validated manifest -> leakage-free split, resized and packed (data/prepared); where the data
has defect masks (and ``tiles.use`` is auto), also the tile model's training tiles (data/prepared/tiles)."""

import json
import shutil
from pathlib import Path

from pipeline.entry import run_stage
from pipeline.prepare import prepare
from pipeline.tiles import prepare_tiles
from pipeline.validate import read_manifest


def main(params):
    manifest = read_manifest(Path("data/validated/manifest.csv"))
    classes = sorted({r["label"] for r in manifest})
    out, masks = Path("data/prepared"), Path("data/raw/masks")
    summary = prepare(
        manifest,
        Path("data/raw/images"),
        classes,
        params.data.ok_class,
        params.data.channels,
        params.prepare,
        out,
        masks_dir=masks,
    )
    shutil.rmtree(out / "tiles", ignore_errors=True)
    tiles = None
    if params.tiles.use == "auto" and masks.is_dir() and any(masks.rglob("*.png")):
        tiles = prepare_tiles(out, Path("data/raw/images"), masks, params.tiles.min_mask_pixels)
    summary["tiles"] = tiles  # None: the whole images alone (tiles.use off, no masks, or no tile covered)
    (out / "prepare.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"prepare: {summary['splits']}; tiles: {tiles or 'none'}")


if __name__ == "__main__":
    run_stage("prepare", main)
