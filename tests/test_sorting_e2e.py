"""Defect-type sorting (`data.ok_class: none`) through every stage with real DVC: no OK class, no threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serving.runner import Runner
from tests.conftest import copy_project, tiny_params, venv_env

pytestmark = pytest.mark.slow  # trains and exports: left out of `make test-fast`


@pytest.fixture(scope="module")
def sorted_project(tmp_path_factory) -> Path:
    """The tiny synthetic configuration with its four classes taken as four defect types."""
    project = copy_project(tmp_path_factory.mktemp("sorting"))
    params = tiny_params(**{"data.ok_class": "none", "tiles.use": "auto"})  # auto: it says why there are none
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=project, env=venv_env(), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"dvc repro failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return project


def read(project: Path, path: str) -> dict:
    return json.loads((project / path).read_text())


def test_every_stage_sorts_defect_types_without_a_threshold(sorted_project: Path):
    classes = ["crack", "ok", "scratch", "spot"]
    prepared = read(sorted_project, "data/prepared/prepare.json")
    assert prepared["ok_class"] is None and "no OK class" in prepared["tiles_reason"]
    evaluation = read(sorted_project, "reports/evaluate/metrics.json")
    assert evaluation["task"] == "defect-type sorting" and evaluation["threshold"] is None
    assert "defect_recall" not in evaluation and 0 <= evaluation["min_class_recall"] <= 1
    assert set(read(sorted_project, "reports/evaluate/headline.json")) == {"accuracy", "min_class_recall"}
    assert set(read(sorted_project, "reports/evaluate/per_class.json")) == set(classes)

    card = read(sorted_project, "models/export/model.card.json")
    assert card["ok_class"] is None and card["threshold"] is None and card["classes"] == classes
    assert "most likely class" in card["outputs"]["defect_score"]
    variants = read(sorted_project, "reports/export/variants.json")["variants"]
    assert set(variants["fp32"]["per_class_recall"]) == set(classes) and "defect_recall" not in variants["fp32"]

    runner = Runner(sorted_project / "models/export/model.onnx", providers="cpu")
    images = sorted((sorted_project / "data/raw/images/spot").glob("*.png"))[:4]
    for row in runner.predict_files(images):
        assert row.error == "" and row.decision == row.label in classes and row.threshold is None
        assert f"most likely class {row.label}" in row.reason
        assert row.defect_score == pytest.approx(max(row.probs.values()), abs=1e-6)

    decision = read(sorted_project, "reports/promote/decision.json")
    assert decision["registered"] and decision["promoted"]
    assert [r["metric"] for r in decision["rules"]] == ["min_class_recall", "accuracy"]
    summary = (sorted_project / "reports/summary.md").read_text()
    assert "no OK class (defect-type sorting)" in summary and "worst class recall" in summary
