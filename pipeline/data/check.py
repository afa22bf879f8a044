"""The data folder checked before anything runs (``defect check``): what ingest and validate would say.

The folder's layout (one subfolder per class, ``data.ok_class`` among them unless it is ``none``), every file
decoded with the validate stage's rules, and its gate (too many bad files, label conflicts, a class too small).
Nothing is copied or written: the problems come back as lines naming the file or key, and what was found is
printed, bad mask annotations included (one line each, naming the file; they stop nothing: their images have
no mask).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import NO_OK_CLASS, ConfigError, Params
from pipeline.data.ingest import MASK_FOLDERS, class_folders, ingest_masks, ok_class_problem
from pipeline.data.validate import GateError, gate, validate

SHOWN = 10  # quarantined files and bad annotations listed one by one; the rest counted


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
        classes = [f.name for f in class_folders(source, sorting=p.data.ok_class == NO_OK_CLASS)]
    except ConfigError as exc:
        return [str(exc)]
    ok_problem = ok_class_problem(source, classes, p.data.ok_class)
    problems = [ok_problem] if ok_problem else []
    accepted, quarantined, summary = validate(source, classes, p.validate)
    print(f"data: {source}: {summary['files']} files, {summary['accepted']} usable {summary['per_class']}")
    masks = ingest_masks(source, classes, p.data.ok_class, None)
    if masks["kind"]:
        where = ", ".join(masks["folders"])
        print(f"masks: {where}: {masks['images']} images, {masks['from_boxes']} of them painted from boxes")
    else:
        looked = ", ".join(str(source.with_name(source.name + s)) for s in MASK_FOLDERS)
        print(f"masks: none found (looked in {looked}): whole-image models only")
    for bad in masks["problems"][:SHOWN]:
        print(f"bad annotation: {bad['file']}: {bad['problem']}")
    if len(masks["problems"]) > SHOWN:
        print(f"bad annotation: {len(masks['problems']) - SHOWN} more (the ingest stage's ingest.json lists them all)")
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
