"""`make bench` on the tiny exported model: every section writes its JSON, the table and the plot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, venv_env

pytestmark = pytest.mark.slow  # runs pipeline stages, servers or trainings: left out of `make test-fast`


def test_bench_measures_runner_torch_http_and_loaders_side_by_side(exported_project, tmp_path):
    work = tmp_path / "project"
    shutil.copytree(exported_project, work, ignore=shutil.ignore_patterns("mlflow.db", "checkpoints"))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench.py"),
            "--project",
            str(work),
            "--quick",
            "--no-compile",
            "--only",
            "inference",
            "sizes",
            "serving",
            "data",
        ],
        cwd=ROOT,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = work / "reports/bench"
    inference = json.loads((out / "inference.json").read_text())
    for bs in (1, 8, 32):  # every contender timed at every batch, ratios against eager in the same run
        rows = inference[f"batch_{bs}"]
        assert {"runner fp32", "torch eager"} <= set(rows) and rows["torch eager"]["vs_eager"] == 1.0
        assert all(r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] for r in rows.values())
    assert inference["end_to_end"]["fp32"]["jpeg_img_s"] > 0
    serving = json.loads((out / "serving.json").read_text())
    for c in (1, 8, 32):
        r = serving[f"concurrency_{c}"]
        assert r["infer_errors"] == 0 and r["classify_errors"] == 0 and r["infer_img_s"] > 0
    assert serving["concurrency_32"]["mean_batch"] > 1  # concurrent clients share model calls
    data = json.loads((out / "data.json").read_text())
    assert all(data[f"workers_{w}"]["torchvision_img_s"] > 0 for w in (0, 1, 2))
    assert set(json.loads((out / "sizes.json").read_text())["jpeg_img_s_by_size"]) == {"96", "128"}
    table = (out / "README.md").read_text()
    for heading in ("## Inference", "## Serving", "## Data loading", "## Targets", "by input size"):
        assert heading in table
    assert (out / "bench.png").stat().st_size > 10_000
