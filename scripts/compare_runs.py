"""Compare two `dvc repro` folders figure by figure: a refactor that claims "behaviour unchanged" must give
the same figures to the last digit with the same seed (timings aside).

    python scripts/compare_runs.py BEFORE_CLONE AFTER_CLONE

Reads the stages' JSON metrics, the per-epoch history (timing columns aside), the test scores and the
trained weights (every tensor of the whole-image model and of the tile model); prints each difference and
a count, and exits 1 when anything differs.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import torch

TIMING = ("img_s", "_ms", "latency", "speedup", "seconds", "elapsed", "data_wait", "device", "lr")
METRICS = [
    "reports/validate/summary.json",
    "reports/augment/orientation.json",
    "reports/train/metrics.json",
    "reports/evaluate/metrics.json",
    "reports/evaluate/per_class.json",
    "reports/export/parity.json",
    "reports/promote/decision.json",
]


def flat(d: object, prefix: str = "") -> dict:
    if isinstance(d, dict):
        return {k: v for key, val in d.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    if isinstance(d, list):
        return {k: v for i, val in enumerate(d) for k, v in flat(val, f"{prefix}{i}.").items()}
    return {prefix[:-1]: d}


def ignored(key: str) -> bool:
    return any(t in key for t in TIMING) or key.endswith(("version", "run_id")) or "model_bytes" in key


def compare_metrics(a: Path, b: Path) -> list[str]:
    diffs = []
    for rel in METRICS:
        fa, fb = flat(json.loads((a / rel).read_text())), flat(json.loads((b / rel).read_text()))
        for k in sorted((set(fa) | set(fb)) - {k for k in set(fa) | set(fb) if ignored(k)}):
            if fa.get(k) != fb.get(k):
                diffs.append(f"{rel}: {k}: {fa.get(k)!r} vs {fb.get(k)!r}")
    return diffs


def compare_tables(a: Path, b: Path) -> list[str]:
    diffs = []
    ra, rb = (list(csv.DictReader(io.StringIO((r / "reports/train/history.csv").read_text()))) for r in (a, b))
    keys = [k for k in ra[0] if not ignored(k)]
    if [{k: r[k] for k in keys} for r in ra] != [{k: r[k] for k in keys} for r in rb]:
        diffs.append("reports/train/history.csv differs")
    if (a / "reports/evaluate/test_scores.csv").read_text() != (b / "reports/evaluate/test_scores.csv").read_text():
        diffs.append("reports/evaluate/test_scores.csv differs")
    return diffs


def compare_weights(a: Path, b: Path) -> list[str]:
    ma, mb = (torch.load(r / "models/train/model.pt", weights_only=True) for r in (a, b))
    diffs = []
    for part in ("model", "tiles"):
        if part not in ma and part not in mb:
            continue
        sa, sb = (m[part] if part == "model" else m.get("tiles", {}).get("model", {}) for m in (ma, mb))
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            diffs.append(f"models/train/model.pt: the {part} weights differ")
    return diffs


def main() -> int:
    a, b = map(Path, sys.argv[1:3])
    diffs = compare_metrics(a, b) + compare_tables(a, b) + compare_weights(a, b)
    print("\n".join(diffs) or f"identical: every figure of {len(METRICS)} metrics files, history, test scores, weights")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
