"""`make run` ends with a summary of a few lines: what trained, the test figures, the export, the registry."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.summary import lines
from pipeline.summary import write as write_summary
from tests.conftest import ROOT, venv_env


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_the_summary_says_what_the_run_achieved_in_a_few_short_lines(tmp_path):
    reports = tmp_path / "reports"
    write(reports / "train/recipe.json", {"members": [0], "tiles": True, "reason": "masks"})
    write(
        reports / "train/metrics.json",
        {"train_images": 830, "device": "cpu", "precision": "bf16", "epochs_run": 30, "train_img_s": 100.0},
    )
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    splits = {"train": {"ok": 400, "scratch": 430}, "val": {"ok": 90, "scratch": 90}, "test": {"ok": 95, "scratch": 92}}
    write(tmp_path / "data/prepared/prepare.json", {"classes": ["ok", "scratch"], "ok_class": "ok", "splits": splits})
    write(
        reports / "evaluate/metrics.json",
        {
            "test_images": 187,
            "accuracy": 0.9305,
            "roc_auc": 0.9801,
            "threshold": 0.0676,
            "defect_recall": 0.9783,
            "false_alarm_rate": 0.4421,
            "operating_point": {
                "status": "below target",
                "target_defect_recall": 0.99,
                "max_false_alarm_rate": 0.01,
                "val_defect_recall": 0.9123,
                "val_defect_parts": 57,
                "val_ok_parts": 140,
                "warnings": ["the val split has 57 defect parts: ..."],
            },
        },
    )
    variants = {"fp32": {"deployable": True}, "int8": {"deployable": False}}
    write(reports / "export/variants.json", {"recommended": {"cpu": "fp32"}, "variants": variants})
    write(
        reports / "promote/decision.json",
        {
            "model_name": "m",
            "challenger": {"version": "3", "variant": "fp32"},
            "promoted": True,
            "champion_after": "3",
            "reason": "first model",
        },
    )
    said = lines(reports, tmp_path)
    text = "\n".join(said)
    assert "1197 images, ok + 1 defect classes (scratch); 830 train / 180 val / 187 test" in text
    assert "tile model" in text and "trained in 4.2 min" in text  # 30 epochs x 830 images at 100 img/s
    assert "threshold: 0.068 (the card's): BELOW TARGET, MARKED FOR REVIEW" in text
    assert "at the 1% false-alarm ceiling it catches only 91.2% of val defects (target 99%)" in text
    assert "warning:   a small val split (57 defect, 140 OK parts)" in text
    assert "97.8% of test defects" in text and "44.2% of OK parts" in text
    assert "fp32 deployable" in text and "int8" not in text.split("GPU boxes")[0]
    assert "version 3 (fp32) now champion\nbecause:   first model" in text
    assert "defect-runner serve --model models:/defect-detection@champion" in text
    assert len(said) <= 14 and all(len(line) <= 120 for line in said)
    md = write_summary(reports).read_text()  # what the promote stage writes and logs to MLflow
    assert md.startswith("# What this run achieved") and "97.8% of test defects" in md and "dvc metrics show" in md


def test_before_any_stage_ran_it_says_so(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.summary"],
        cwd=tmp_path,
        env=venv_env() | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "run `dvc repro`" in proc.stdout


def test_a_refused_model_of_other_classes_is_said_so(tmp_path):
    reason = "champion classes [ok, scratch] vs challenger [ok, dent]: a different product"
    decision = {"model_name": "m", "challenger": {"version": None, "variant": "fp32"}, "promoted": False}
    write(tmp_path / "promote/decision.json", decision | {"comparable": False, "champion_after": "2", "reason": reason})
    said = "\n".join(lines(tmp_path, tmp_path))
    assert "registry:  not registered under m: another product's classes" in said and reason in said
    assert "version None" not in said
