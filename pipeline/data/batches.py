"""New labeled batches: the retraining entry point (``defect ingest NEW_FOLDER``).

A batch is a folder of newly labeled images in class subfolders. ``add_batch`` checks every file with
the validate stage's rules, drops exact duplicates of images already in the dataset (or earlier in the
batch), refuses files whose content already exists under another label (a label conflict, reported
with both paths), flags near-duplicates of existing images that carry another label, and copies the
rest to ``batches/<name>/<class>/``. ``batches/<name>.json`` records what was added and what was
dropped, and why. The ingest stage reads every batch after the main source, so the next ``dvc repro``
validates, splits and trains on old plus new; each image's split follows from its content hash, so
no existing image changes split. With DVC, the batch folder is ``dvc add``-ed: its bytes are versioned
and pushed like the rest of the data, and git keeps the small ``.dvc`` and ``.json`` files.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from pipeline.config import ConfigError, Params
from pipeline.data.ingest import class_folders
from pipeline.data.validate import check_file, read_manifest

log = logging.getLogger(__name__)
BATCHES_DIR = Path("batches")


def known_images(manifest: Path, batches_dir: Path) -> list[dict]:
    """Every image already in the dataset: the validated manifest plus batches not ingested yet."""
    rows: list[dict] = []
    if manifest.is_file():
        rows += [{k: r[k] for k in ("path", "label", "sha256", "dhash")} for r in read_manifest(manifest)]
    for report in sorted(batches_dir.glob("*.json")):
        rows += [{**r, "path": f"{report.stem}:{r['path']}"} for r in json.loads(report.read_text())["added"]]
    return rows


def known_classes(params: Params, raw_summary: Path) -> list[str]:
    if raw_summary.is_file():
        return sorted(json.loads(raw_summary.read_text())["counts"])
    if params.data.source == "synthetic":
        return sorted(params.data.synthetic.counts)
    return [f.name for f in class_folders(Path(params.data.source))]


def add_batch(
    source: Path,
    params: Params,
    name: str | None = None,
    batches_dir: Path = BATCHES_DIR,
    manifest: Path = Path("data/validated/manifest.csv"),
    raw_summary: Path = Path("data/raw/ingest.json"),
    allow_new_class: bool = False,
) -> dict:
    """Check ``source`` against the dataset and copy what is new and sound into ``batches_dir/<name>``."""
    if not source.is_dir():
        raise ConfigError(f"{source}: not a folder (expected one subfolder per class)")
    folders = sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise ConfigError(f"{source}: no class subfolders (expected e.g. ok/, scratch/, ...)")
    classes = known_classes(params, raw_summary)
    new = [f.name for f in folders if f.name not in classes]
    if new and not allow_new_class:
        raise ConfigError(
            f"{source}: class folder(s) {', '.join(new)} are not classes of the dataset ({', '.join(classes)}); "
            "rename them, or pass --allow-new-class to add a class (the model then gets a new output)"
        )
    name = name or time.strftime("%Y%m%d-%H%M%S")
    dest = batches_dir / name
    if dest.exists() or (batches_dir / f"{name}.json").exists():
        raise ConfigError(f"batch {name!r} exists already in {batches_dir}; choose another --name")

    known = known_images(manifest, batches_dir)
    by_sha = {r["sha256"]: r for r in known}
    known_bits = (
        np.unpackbits(np.stack([np.frombuffer(bytes.fromhex(r["dhash"]), np.uint8) for r in known]), axis=1)
        if known
        else np.zeros((0, 256), np.uint8)
    )
    added, dropped, warnings = [], [], []
    for folder in folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
            rel = f"{folder.name}/{path.relative_to(folder).as_posix()}"
            rec, bits = check_file(path, rel, folder.name, params.validate)
            seen = by_sha.get(rec.sha256) if not rec.reason else None
            if rec.reason:
                dropped.append({"path": rel, "reason": rec.reason})
            elif seen and seen["label"] == rec.label:
                dropped.append({"path": rel, "reason": f"duplicate of {seen['path']}, already in the dataset"})
            elif seen:
                dropped.append(
                    {"path": rel, "reason": f"label conflict: same content as {seen['path']} labeled {seen['label']}"}
                )
            else:
                if len(known_bits):
                    dist = (known_bits != bits.astype(np.uint8)).sum(axis=1)
                    close = [known[i] for i in np.nonzero(dist <= params.validate.near_duplicate_bits)[0]]
                    other = [r for r in close if r["label"] != rec.label]
                    if other:
                        warnings.append(
                            f"{rel}: near-duplicate of {other[0]['path']} labeled {other[0]['label']} (kept; check it)"
                        )
                row = {"path": rel, "label": rec.label, "sha256": rec.sha256, "dhash": rec.dhash}
                added.append(row)
                by_sha[rec.sha256] = {**row, "path": f"{name}:{rel}"}
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
    counts: dict[str, int] = {}
    for r in added:
        counts[r["label"]] = counts.get(r["label"], 0) + 1
    report = {
        "name": name,
        "source": str(source.resolve()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "counts": counts,
        "added": added,
        "dropped": dropped,
        "warnings": warnings,
    }
    batches_dir.mkdir(parents=True, exist_ok=True)
    (batches_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def dvc_track(folder: Path) -> str:
    """``dvc add`` the batch folder when this is a DVC project; returns what happened, for the user."""
    if not Path(".dvc").is_dir() or not folder.is_dir():
        return "not a DVC project here: the batch is a plain folder"
    proc = subprocess.run(["dvc", "add", "-q", str(folder)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"dvc add {folder} failed: {proc.stderr.strip()[-300:]}"
    return f"tracked with DVC: git add {folder}.dvc {folder.parent}/.gitignore {folder}.json && dvc push"
