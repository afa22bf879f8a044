"""Ingest: bring labeled images into ``data/raw`` (synthetic generator or a folder of class subfolders).

The raw copy is DVC-tracked, so every model can be traced to the exact bytes it was trained on, and
nothing downstream ever touches the user's source folder.

Defect masks come from sibling folders of the source (``MASK_FOLDERS``: ``<source>_masks``,
``<source>_annotations``, ``<source>_boxes``) laid out like it: ``<class>/<stem>.png``, a mask, is copied;
``<class>/<stem>.xml``, Pascal VOC boxes, is painted into a mask the size of its image. Either way the
result is ``data/raw/masks/<class>/<stem>.png``, so every later stage reads one kind of mask. A bad
annotation is one problem in ``ingest.json``, never the end of the ingest: its image has no mask (unknown).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from PIL import Image

from pipeline.config import NO_OK_CLASS, ConfigError, DataConfig
from pipeline.data import synthetic
from pipeline.data.masks import box_mask, shown_size, voc_boxes

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".gif"}
MASK_FOLDERS = ("_masks", "_annotations", "_boxes")  # <source><suffix>: where masks and boxes are looked for


def class_folders(source: Path, sorting: bool = False) -> list[Path]:
    """The class subfolders of a dataset folder (hidden folders skipped), with clear errors. ``sorting``:
    defect-type sorting (``data.ok_class: none``), where no class is OK."""
    if not source.exists():
        raise ConfigError(f"data.source: folder {source} does not exist")
    if not source.is_dir():
        raise ConfigError(f"data.source: {source} is not a folder (expected one subfolder per class)")
    folders = sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ConfigError(f"data.source: {source} has no class subfolders (expected e.g. ok/, scratch/, ...)")
    if len(folders) < 2:
        needs = (
            "defect-type sorting (data.ok_class: none) needs at least two defect classes"
            if sorting
            else "a defect model needs the OK class and at least one defect class"
        )
        raise ConfigError(f"data.source: {source} has a single class folder ({folders[0].name}); {needs}")
    return folders


def ok_class_problem(source: Path, classes: list[str], ok_class: str) -> str | None:
    """The error when ``data.ok_class`` names none of the class folders; None when it does or is ``none``."""
    if ok_class == NO_OK_CLASS or ok_class in classes:
        return None
    return (
        f"data.ok_class: {ok_class!r} is not a class folder of {source} (found: {', '.join(classes)}); use "
        f"data.ok_class: {NO_OK_CLASS} for defect-type sorting without an OK class"
    )


def visible_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` whose name does not start with a dot, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def copy_files(folder: Path, dest: Path) -> int:
    """Copy every (non-hidden) file under ``folder`` to ``dest``, keeping subfolders; return the count."""
    files = visible_files(folder)
    for f in files:
        target = dest / f.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    return len(files)


def ingest_folder(source: Path, ok_class: str, images_dir: Path) -> dict[str, int]:
    """Copy every file under each class folder into ``images_dir/<class>/``; return the count per class.

    All files are copied, not only known image extensions: the validate stage decides what is an image
    and records why anything is rejected.
    """
    folders = class_folders(source, sorting=ok_class == NO_OK_CLASS)
    problem = ok_class_problem(source, [f.name for f in folders], ok_class)
    if problem:
        raise ConfigError(problem)
    return {folder.name: copy_files(folder, images_dir / folder.name) for folder in folders}


def ingest_masks(source: Path, classes: list[str], ok_class: str, masks_dir: Path | None) -> dict:
    """The masks of the images of ``source`` from its ``MASK_FOLDERS``, written as ``masks_dir/<class>/<stem>.png``
    (nothing is written when ``masks_dir`` is None: ``defect check`` wants only the problems).

    A mask or annotation belongs to the image with the same path but for the extension; where an image has
    both, the PNG mask wins and the XML is not read. Boxes are painted by ``masks.voc_boxes`` and
    ``masks.box_mask`` at the image's size read from its header; an image Pillow cannot open gets no mask
    (the validate stage quarantines it). An XML with any bad box gives no mask at all: half the boxes would
    call the rest of the defect clean. Returns ingest.json's ``masks`` entry (see ``ingest``).
    """
    images: dict[str, Path] = {}  # "<class>/<stem>" (subfolders kept) -> the image in source
    for c in classes:
        for f in visible_files(source / c):
            if f.suffix.lower() in IMAGE_EXTENSIONS:
                images.setdefault(f.relative_to(source).with_suffix("").as_posix(), f)
    folders = [f for f in (source.with_name(source.name + s) for s in MASK_FOLDERS) if f.is_dir()]
    found: dict[str, dict[str, Path]] = {".png": {}, ".xml": {}}  # by extension: image key -> file
    problems: list[dict[str, str]] = []
    for folder in folders:
        for f in visible_files(folder):
            if f.suffix.lower() not in found:
                continue
            key = f.relative_to(folder).with_suffix("").as_posix()
            if key in images:
                found[f.suffix.lower()].setdefault(key, f)
            else:
                expected = f"expected the path of an image of {source} ({key}.jpg, .png, ...) under its class folder"
                problems.append({"file": str(f), "problem": f"no image {key}.*; {expected}"})
    pngs, xmls = found[".png"], found[".xml"]

    def target(key: str) -> Path:
        path = masks_dir / f"{key}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    painted = 0
    for key, xml in xmls.items():
        if key in pngs:
            continue  # the PNG mask wins
        size = shown_size(images[key])
        if size is None:
            continue  # an image Pillow cannot open: the validate stage quarantines it
        boxes, bad = voc_boxes(xml, size)
        if not boxes and not bad and key.split("/")[0] != ok_class:
            bad = ["no <object> with a <bndbox>; expected the boxes of the defect (its mask stays unknown)"]
        problems += [{"file": str(xml), "problem": text} for text in bad]
        if boxes and not bad:
            if masks_dir is not None:
                Image.fromarray(box_mask(boxes, size)).save(target(key))
            painted += 1
    if masks_dir is not None:
        for key, png in pngs.items():
            shutil.copyfile(png, target(key))
    kinds = [kind for kind, files in (("masks", pngs), ("boxes", xmls)) if files]
    return {
        "folders": [str(f) for f in folders],
        "kind": "both" if len(kinds) == 2 else (kinds[0] if kinds else None),
        "images": len(pngs) + painted,
        "from_boxes": painted,
        "problems": problems,
    }


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
    """Fill ``out_dir/images`` and ``out_dir/masks`` from ``cfg.source`` and the batches; return the summary
    written to ``out_dir/ingest.json``.

    Its ``masks`` entry: ``folders`` (the mask folders found beside the source), ``kind`` ("masks" for PNG
    masks, "boxes" for Pascal VOC files, "both", or null when there are none), ``images`` (how many images got
    a mask), ``from_boxes`` (how many of those were painted from boxes) and ``problems`` (one
    ``{"file", "problem"}`` per bad annotation, the problem saying what was expected). ``ok_class`` is null
    for defect-type sorting (``data.ok_class: none``).
    """
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a stage output: DVC expects it rebuilt from scratch
    images_dir, masks_dir = out_dir / "images", out_dir / "masks"
    images_dir.mkdir(parents=True)
    masks_dir.mkdir(parents=True)
    if cfg.source == "synthetic":
        records = synthetic.generate(
            images_dir,
            masks_dir,
            cfg.synthetic.counts,
            cfg.synthetic.image_size,
            cfg.channels,
            cfg.seed,
            contrast=cfg.synthetic.contrast,
        )
        counts: dict[str, int] = {}
        for r in records:
            counts[r["label"]] = counts.get(r["label"], 0) + 1
        drawn = len(list(masks_dir.rglob("*.png")))
        masks = {"folders": [], "kind": "masks", "images": drawn, "from_boxes": 0, "problems": []}
    else:
        counts = ingest_folder(Path(cfg.source), cfg.ok_class, images_dir)
        masks = ingest_masks(Path(cfg.source), list(counts), cfg.ok_class, masks_dir)
    batches = ingest_batches(batches_dir, images_dir, counts)
    summary = {
        "source": cfg.source,
        "ok_class": None if cfg.ok_class == NO_OK_CLASS else cfg.ok_class,
        "counts": counts,
        "total": sum(counts.values()),
        "batches": batches,
        "masks": masks,
    }
    (out_dir / "ingest.json").write_text(json.dumps(summary, indent=2) + "\n")
    log.info("ingested %d files from %s: %s; %d with a mask", summary["total"], cfg.source, counts, masks["images"])
    if masks["problems"]:
        first = masks["problems"][0]
        log.warning(
            "%d bad annotations (their images have no mask), all listed in %s; the first: %s: %s",
            len(masks["problems"]),
            out_dir / "ingest.json",
            first["file"],
            first["problem"],
        )
    return summary
