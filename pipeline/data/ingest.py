"""Ingest: bring labeled images into ``data/raw`` (synthetic generator or a folder of class subfolders).

The raw copy is DVC-tracked, so every model can be traced to the exact bytes it was trained on, and
nothing downstream ever touches the user's source folder.
"""

from __future__ import annotations

from pipeline.data import synthetic
import json
import logging
import shutil
from pathlib import Path

from pipeline.config import ConfigError, DataConfig

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif"}


def class_folders(source: Path) -> list[Path]:
    """The class subfolders of a dataset folder (hidden folders skipped), with clear errors."""
    if not source.exists():
        raise ConfigError(f"data.source: folder {source} does not exist")
    if not source.is_dir():
        raise ConfigError(f"data.source: {source} is not a folder (expected one subfolder per class)")
    folders = sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ConfigError(f"data.source: {source} has no class subfolders (expected e.g. ok/, scratch/, ...)")
    if len(folders) < 2:
        raise ConfigError(
            f"data.source: {source} has a single class folder ({folders[0].name}); a defect model needs the OK "
            "class and at least one defect class"
        )
    return folders


def copy_files(folder: Path, dest: Path) -> int:
    """Copy every (non-hidden) file under ``folder`` to ``dest``, keeping subfolders; return the count."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    for f in files:
        target = dest / f.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return len(files)


def ingest_folder(source: Path, ok_class: str, images_dir: Path, masks_dir: Path) -> dict[str, int]:
    """Copy every file under each class folder into ``images_dir/<class>/``.

    All files are copied, not only known image extensions: the validate stage decides what is an image
    and records why anything is rejected. Masks are taken from a sibling folder ``<source>_masks`` with
    the same layout when it exists (``<class>/<stem>.png``).
    """
    folders = class_folders(source)
    names = [f.name for f in folders]
    if ok_class not in names:
        raise ConfigError(f"data.ok_class: {ok_class!r} is not a class folder of {source} (found: {', '.join(names)})")
    counts = {folder.name: copy_files(folder, images_dir / folder.name) for folder in folders}
    mask_source = source.with_name(source.name + "_masks")
    if mask_source.is_dir():
        for folder in folders:
            if (mask_source / folder.name).is_dir():
                shutil.copytree(mask_source / folder.name, masks_dir / folder.name, dirs_exist_ok=True)
    return counts


def ingest_batches(batches_dir: Path, images_dir: Path, counts: dict[str, int]) -> dict[str, int]:
    """Add every batch (``batches/<name>/<class>/...``, made by ``defect ingest``) under its class folder
    as ``<class>/batch-<name>/...``; update ``counts``; return images per batch."""
    added: dict[str, int] = {}
    if not batches_dir.is_dir():
        return added
    for batch in sorted(p for p in batches_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        n = 0
        for folder in sorted(p for p in batch.iterdir() if p.is_dir()):
            copied = copy_files(folder, images_dir / folder.name / f"batch-{batch.name}")
            counts[folder.name] = counts.get(folder.name, 0) + copied
            n += copied
        added[batch.name] = n
    return added


def ingest(cfg: DataConfig, out_dir: Path, batches_dir: Path = Path("batches")) -> dict:
    """Fill ``out_dir/images`` (and ``out_dir/masks``) from ``cfg.source`` and the batches; return a summary."""
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a stage output: DVC expects it rebuilt from scratch
    images_dir, masks_dir = out_dir / "images", out_dir / "masks"
    images_dir.mkdir(parents=True)
    masks_dir.mkdir(parents=True)
    if cfg.source == "synthetic":
        records = synthetic.generate(
            images_dir, masks_dir, cfg.synthetic.counts, cfg.synthetic.image_size, cfg.channels, cfg.seed,
            contrast=cfg.synthetic.contrast,
        )
        counts: dict[str, int] = {}
        for r in records:
            counts[r["label"]] = counts.get(r["label"], 0) + 1
    else:
        counts = ingest_folder(Path(cfg.source), cfg.ok_class, images_dir, masks_dir)
    batches = ingest_batches(batches_dir, images_dir, counts)
    summary = {
        "source": cfg.source,
        "ok_class": cfg.ok_class,
        "counts": counts,
        "total": sum(counts.values()),
        "batches": batches,
    }
    (out_dir / "ingest.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("ingested %d files from %s: %s", summary["total"], cfg.source, counts)
    return summary
