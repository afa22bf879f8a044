"""What a `dvc repro` achieved, in a few lines a person reads in seconds.

    python -m pipeline.summary            # from the project root, after dvc repro (`make run` ends with it)

Reads the stages' small JSON reports (``reports/``); a stage that has not run yet is said so, not guessed.
The promote stage, the last, writes the same lines to ``reports/summary.md`` and logs them to the model's
MLflow run. ``dvc metrics show`` still lists every figure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def lines(reports: Path = Path("reports")) -> list[str]:
    out = []
    recipe, train = _read(reports / "train/recipe.json"), _read(reports / "train/metrics.json")
    if train:
        what = "a tile model beside the whole-image model" if recipe and recipe["tiles"] else "whole images"
        out.append(f"trained:   {what} on {train['train_images']} images ({train['device']}, {train['precision']})")
    ev = _read(reports / "evaluate/metrics.json")
    if ev:
        auc = ev["roc_auc"]
        out.append(
            f"test:      {ev['test_images']} images, accuracy {ev['accuracy']:.3f}, defect-vs-OK ROC AUC {auc:.3f}"
        )
        out.append(
            f"at the card's threshold {ev['threshold']:.3f}: catches {ev['defect_recall']:.1%} of defects, "
            f"flags {ev['false_alarm_rate']:.1%} of OK parts"
        )
        out.append(
            f"at the val-chosen low-false-alarm cut: catches {ev['defect_recall_at_far_threshold']:.1%} of defects, "
            f"flags {ev['false_alarm_rate_at_far_threshold']:.1%} of OK parts"
        )
    ex = _read(reports / "export/variants.json")
    if ex:
        ok = [v for v, r in ex["variants"].items() if r["deployable"]]
        out.append(f"exported:  {', '.join(ok)} deployable; recommended {ex['recommended']}")
    d = _read(reports / "promote/decision.json")
    if d:
        c = d["challenger"]
        verdict = "now champion" if d["promoted"] else f"stays challenger (champion: version {d['champion_after']})"
        out.append(f"registry:  {d['model_name']} version {c['version']} ({c['variant']}) {verdict}: {d['reason']}")
    return out or ["no stage has written its report yet: run `dvc repro`"]


def write(reports: Path = Path("reports")) -> Path:
    """``reports/summary.md``: the lines, and where the detail is."""
    path = reports / "summary.md"
    body = "\n".join(f"    {line}" for line in lines(reports))
    more = "Detail: `reports/<stage>/` (metrics JSON and plots), `dvc metrics show`, the MLflow run (`make ui`)."
    path.write_text(f"# What this run achieved\n\n{body}\n\n{more}\n")
    return path


def main() -> int:
    print("\n".join(lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
