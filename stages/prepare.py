"""Stage prepare: validated manifest -> leakage-free split, resized and packed (data/prepared)."""

from pathlib import Path

from pipeline.entry import run_stage
from pipeline.prepare import prepare
from pipeline.validate import read_manifest


def main(params):
    manifest = read_manifest(Path("data/validated/manifest.csv"))
    classes = sorted({r["label"] for r in manifest})
    summary = prepare(
        manifest,
        Path("data/raw/images"),
        classes,
        params.data.ok_class,
        params.data.channels,
        params.prepare,
        Path("data/prepared"),
        masks_dir=Path("data/raw/masks"),
    )
    print(f"prepare: {summary['splits']}")


if __name__ == "__main__":
    run_stage("prepare", main)
