"""The data folder checked before anything runs (``defect check``): what ingest and validate would say.

The folder's layout (one subfolder per class, ``data.ok_class`` among them), every file decoded with the
validate stage's rules, and its gate (too many bad files, label conflicts, a class too small). Nothing is
copied or written: the problems come back as lines naming the file or key, and what was found is printed.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import ConfigError, Params
from pipeline.data.ingest import class_folders
from pipeline.data.validate import GateError, gate, validate

SHOWN = 10  # quarantined files listed one by one; the rest counted


def check_data(p: Params) -> list[str]:
    """Problems that would stop the ingest or validate stage, one line each ([] when none)."""
    if p.data.source == "synthetic":
        counts = p.data.synthetic.counts
        print(
            f"data: the built-in generator, {sum(counts.values())} images of {p.data.synthetic.image_size} px {counts}"
        )
        return []
    source = Path(p.data.source)
    try:
        classes = [f.name for f in class_folders(source)]
    except ConfigError as exc:
        return [str(exc)]
    problems = []
    if p.data.ok_class not in classes:
        problems.append(
            f"data.ok_class: {p.data.ok_class!r} is not a class folder of {source} (found: {', '.join(classes)})"
        )
    accepted, quarantined, summary = validate(source, classes, p.validate)
    masks = source.with_name(source.name + "_masks")
    print(f"data: {source}: {summary['files']} files, {summary['accepted']} usable {summary['per_class']}")
    print(f"masks: {masks}" if masks.is_dir() else f"masks: none ({masks} absent): whole-image models only")
    if summary["near_duplicate_images"]:
        print(f"near-duplicates: {summary['near_duplicate_images']} images (kept together in one split)")
    for rec in quarantined[:SHOWN]:
        print(f"left out: {source / rec.path}: {rec.reason}")
    if len(quarantined) > SHOWN:
        print(f"left out: {len(quarantined) - SHOWN} more files (the validate stage lists them all)")
    try:
        gate(summary, quarantined, p.validate)
    except GateError as exc:
        problems.append(str(exc).replace("data/validated/quarantine.csv", "the validate stage's quarantine.csv"))
    return problems
