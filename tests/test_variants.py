"""fp16 and int8 variants: scored against fp32 on the test set, gated, and the gate respected."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pipeline.data.prepare import load_split
from serving.card import ModelCard, card_path_for, sha256_file
from serving.runner import Runner, RunnerError
from tests.conftest import run_stages_in, tiny_params

VARIANTS = ("fp32", "fp16", "int8")


def export_dir(project):
    return project / "models/export"


def test_every_variant_is_written_with_a_card_that_matches_its_file(exported_project):
    report = json.loads((exported_project / "reports/export/variants.json").read_text())
    for v in VARIANTS:
        path = export_dir(exported_project) / ("model.onnx" if v == "fp32" else f"model.{v}.onnx")
        card = ModelCard.read(card_path_for(path))
        assert card.variant == v and card.sha256 == sha256_file(path)
        assert card.parity["accuracy"] == pytest.approx(report["variants"][v]["accuracy"])
        assert card.recommended == report["recommended"]
        row = report["variants"][v]
        for key in ("defect_recall", "false_alarm_rate", "decision_flips", "score_max_abs_diff", "model_bytes"):
            assert key in row
        assert set(row["per_class_recall"]) == set(card.classes)
        assert row["latency"]["batch_1_p50_ms"] > 0
    assert report["recommended"]["cuda"] != "int8"  # QDQ int8 on the plain CUDA provider is slower than fp32
    sizes = {v: report["variants"][v]["model_bytes"] for v in VARIANTS}
    assert sizes["int8"] < sizes["fp16"] < sizes["fp32"]
    for name in ("variants.md", "variants.png", "parity.json"):
        assert (exported_project / "reports/export" / name).stat().st_size > 0


def test_variants_score_the_test_set_like_fp32(exported_project):
    x_test, _, _ = load_split(exported_project / "data/prepared", "test")
    fp32 = Runner(export_dir(exported_project) / "model.onnx", providers="cpu").predict(x_test)[1]
    report = json.loads((exported_project / "reports/export/variants.json").read_text())["variants"]
    for v in ("fp16", "int8"):
        runner = Runner(export_dir(exported_project) / f"model.{v}.onnx", providers="cpu", force=True)
        probs, score = runner.predict(x_test)
        assert probs.dtype == np.float32 and score.shape == fp32.shape  # the runner's contract holds
        assert np.abs(score - fp32).max() == pytest.approx(report[v]["score_max_abs_diff"], abs=2e-3)
    assert report["fp16"]["score_max_abs_diff"] < 0.01


def test_the_gate_marks_a_variant_not_deployable_and_the_runner_refuses_it(exported_project, tmp_path):
    shutil.copytree(exported_project, tmp_path, dirs_exist_ok=True)
    params = tiny_params(**{"model.name": "test_efficientnet"})
    params["export"]["max_defect_recall_drop"] = -1.0  # no variant can meet this: it must be marked, not shipped
    run_stages_in(tmp_path, params, ["export"])  # fp32 still passes parity, so the stage succeeds
    for v in ("fp16", "int8"):
        path = export_dir(tmp_path) / f"model.{v}.onnx"
        card = ModelCard.read(card_path_for(path))
        assert not card.deployable and "export.max_defect_recall_drop=-1.0" in card.not_deployable_reason
        with pytest.raises(RunnerError, match="not deployable"):
            Runner(path, providers="cpu")
        Runner(path, providers="cpu", force=True)  # kept for inspection
    fp32 = ModelCard.read(card_path_for(export_dir(tmp_path) / "model.onnx"))
    assert fp32.deployable and fp32.recommended == {"cpu": "fp32", "cuda": "fp32", "tensorrt": "fp32"}
    table = (tmp_path / "reports/export/variants.md").read_text()
    assert "| int8 | no: defect recall" in table


@pytest.mark.parametrize("method", ["Entropy", "Percentile"])
def test_each_calibration_method_gives_a_working_int8_model(exported_project, tmp_path, method):
    import dataclasses

    from pipeline.config import params_from_dict
    from pipeline.export.variants import calibration_images, make_int8, write_card

    cfg = params_from_dict(tiny_params()).export
    cfg = dataclasses.replace(cfg, int8=dataclasses.replace(cfg.int8, calibration_method=method))
    x_train, _, _ = load_split(exported_project / "data/prepared", "train")
    out = tmp_path / "model.int8.onnx"
    make_int8(export_dir(exported_project) / "model.onnx", out, calibration_images(x_train, 16, 0), cfg)
    card = ModelCard.read(card_path_for(export_dir(exported_project) / "model.int8.onnx"))
    write_card(card, out)  # embedded and beside it: a sidecar alone would not match the graph's card
    probs, score = Runner(out, providers="cpu", force=True).predict(x_train[:4])
    assert probs.shape == (4, len(card.classes)) and np.isfinite(score).all()


def test_a_variant_that_flags_every_ok_image_is_not_deployable():
    """Measured on an ensemble's int8 export: every score moved up by ~0.13, so at the card's threshold it
    flagged all test OK images; its recall rose and its accuracy fell by only 0.011."""
    from pipeline.config import params_from_dict
    from pipeline.export.variants import gate

    cfg = params_from_dict(tiny_params()).export
    row = {"prob_max_abs_diff": 1e-5, "speedup_vs_fp32": 1.0}
    report = {
        "fp32": row | {"accuracy": 0.925, "defect_recall": 0.978, "false_alarm_rate": 0.084},
        "fp16": row | {"accuracy": 0.925, "defect_recall": 0.978, "false_alarm_rate": 0.095},
        "int8": row | {"accuracy": 0.914, "defect_recall": 1.0, "false_alarm_rate": 1.0, "speedup_vs_fp32": 1.07},
    }
    reasons = gate(report, cfg)
    assert reasons["fp32"] == "" and reasons["fp16"] == ""  # one more OK image flagged of 95: within 0.02
    assert reasons["int8"] == "false alarms 1.000 vs fp32 0.084: rise 0.916 > export.max_false_alarm_rise=0.02"
