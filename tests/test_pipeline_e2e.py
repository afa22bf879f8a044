"""The whole chain through real DVC: `dvc repro` on a tiny configuration, then a no-op repro."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_project, tiny_params, venv_env

pytestmark = pytest.mark.slow  # runs pipeline stages, servers or trainings: left out of `make test-fast`


def dvc(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=cwd, env=venv_env(), capture_output=True, text=True, timeout=900
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def repro(tmp_path_factory) -> Path:
    project = copy_project(tmp_path_factory.mktemp("project"))
    (project / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    proc = dvc(project, "repro")
    (project / "repro.log").write_text(proc.stdout + proc.stderr)
    return project


def test_every_stage_wrote_its_outputs(repro: Path):
    for path in [
        "data/raw/images/ok",
        "data/raw/masks/crack",
        "data/validated/manifest.csv",
        "data/prepared/train.npz",
        "reports/augment/preview.png",
        "models/train/model.pt",
        "reports/train/history.csv",
        "reports/evaluate/confusion_matrix.png",
        "models/export/model.onnx",
        "models/export/model.card.json",
        "reports/benchmark/metrics.json",
        "reports/evaluate/heatmaps.png",
        "reports/evaluate/precision_recall.png",
        "reports/promote/decision.json",
        "mlflow.db",
    ]:
        assert (repro / path).exists(), f"{path} missing after dvc repro"
    pose = json.loads((repro / "reports/augment/orientation.json").read_text())
    assert pose["orientation"] == "free" and pose["images"] > 0 and pose["flips_and_turns"] == "kept"
    assert pose["pose"] == "free"  # measured and reported: synthetic defects come in every orientation
    summary = json.loads((repro / "reports/validate/summary.json").read_text())
    assert summary["accepted"] == 60 and summary["quarantined"] == 0
    card = json.loads((repro / "models/export/model.card.json").read_text())
    assert card["classes"] == ["crack", "ok", "scratch", "spot"] and card["ok_class"] == "ok"
    assert card["input"] == {"size": 64, "channels": 3, "resize": "letterbox", "layout": "NHWC", "dtype": "uint8"}
    parity = json.loads((repro / "reports/export/parity.json").read_text())
    assert parity["fp32"]["deployable"] == 1 and parity["fp32"]["prob_max_abs_diff"] <= 1e-3
    assert set(parity) == {"fp32", "fp16", "int8"}
    # evaluate scores at full precision, so its figures are the fp32 export's (the card's threshold is its)
    evaluation = json.loads((repro / "reports/evaluate/metrics.json").read_text())
    for key in ("accuracy", "defect_recall", "false_alarm_rate"):
        assert parity["fp32"][key] == pytest.approx(evaluation[key]), key
    for variant in ("fp16", "int8"):
        assert (repro / f"models/export/model.{variant}.onnx").exists()
    bench = json.loads((repro / "reports/benchmark/metrics.json").read_text())
    runners = {k for k in bench["batch_4"] if k.startswith("runner ")}
    assert runners == {"runner fp32", "runner fp16", "runner int8"} and bench["batch_1"]["runner fp32"]["p50_ms"] > 0
    assert bench["batch_4"]["torch eager"]["vs_eager"] == 1.0 and bench["batch_4"]["runner fp32"]["vs_eager"] > 0
    assert set(bench["end_to_end"]["int8"]) == {"png_img_s", "jpeg_img_s"}
    http = bench["http"]  # a real `defect-runner serve` under load: every request answered
    assert http["infer_img_s"] > 0 and http["infer_errors"] == 0 and http["classify_errors"] == 0
    assert (repro / "reports/benchmark/benchmark.png").exists()


def test_metrics_show_lists_the_headline_and_fits_a_terminal(repro: Path):
    metrics = json.loads(dvc(repro, "metrics", "show", "--json").stdout)
    files = {f for ws in metrics.values() for f in ws["data"]}
    assert files == {"reports/evaluate/headline.json", "reports/promote/headline.json"}
    headline = metrics[""]["data"]["reports/evaluate/headline.json"]["data"]
    detail = json.loads((repro / "reports/evaluate/metrics.json").read_text())
    assert headline == {k: round(detail[k], 4) for k in headline}
    assert set(headline) == {"accuracy", "defect_recall", "false_alarm_rate"}
    assert metrics[""]["data"]["reports/promote/headline.json"]["data"] == {"champion": True}  # the first model
    table = dvc(repro, "metrics", "show").stdout.splitlines()
    assert len(table) <= 4 and max(map(len, table)) <= 120, table


def test_dag_is_the_chain(repro: Path):
    out = dvc(repro, "dag", "--dot").stdout
    for a, b in [
        ("ingest", "validate"),
        ("validate", "prepare"),
        ("prepare", "augment"),
        ("augment", "train"),
        ("train", "evaluate"),
        ("evaluate", "export"),
        ("export", "benchmark"),
        ("benchmark", "promote"),
    ]:
        assert f'"{a}" -> "{b}"' in out, f"no edge {a} -> {b} in:\n{out}"


def test_second_repro_reruns_nothing(repro: Path):
    out = dvc(repro, "repro").stdout
    assert "Running stage" not in out, out
    status = dvc(repro, "status").stdout
    assert "up to date" in status, status


def test_one_mlflow_run_holds_every_stage(repro: Path):
    import mlflow

    run_id = json.loads((repro / "models/train/run.json").read_text())["run_id"]
    uri = f"sqlite:///{repro / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    run = client.get_run(run_id)
    assert "val_loss" in run.data.metrics and "test_accuracy" in run.data.metrics
    assert "export_fp32_prob_max_abs_diff" in run.data.metrics and "export_int8_defect_recall" in run.data.metrics
    assert "bench_b1_runner_fp32_vs_eager" in run.data.metrics and "data_accepted" in run.data.metrics
    assert run.data.tags["export.recommended.cuda"] in ("fp16", "fp32")
    assert run.data.params["model.name"] == yaml.safe_load((repro / "params.yaml").read_text())["model"]["name"]
    assert run.data.tags["git.commit"]
    assert run.data.tags["promote.decision"] == "champion"  # the first model
    assert "test_pointing_game" in run.data.metrics and "dvc.prepare.data/prepared" in run.data.tags
    evaluate = {a.path for a in client.list_artifacts(run_id, "evaluate")}
    assert {"evaluate/heatmaps.png", "evaluate/precision_recall.png", "evaluate/roc.png"} <= evaluate
    version = client.get_model_version_by_alias("defect-detection", "champion")
    assert version.run_id == run_id


def test_promote_acts_on_the_registry_even_when_dvc_remembers_the_same_run(repro: Path):
    """DVC's run cache would restore decision.json for the same inputs and skip the registry."""
    import mlflow

    uri = f"sqlite:///{repro / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    champion = str(client.get_model_version_by_alias("defect-detection", "champion").version)
    registry = json.loads((repro / "reports/promote/registry.json").read_text())
    assert registry["model_name"] == "defect-detection"
    assert registry["champion"] == registry["challenger"] == champion  # the first model
    assert registry["tracking_uri"].endswith("mlflow.db"), registry

    # The registry forgets the alias (a new tracking server, someone's manual edit) and the outputs are gone:
    # the stage's inputs are exactly those of the run DVC already made.
    client.delete_registered_model_alias("defect-detection", "champion")
    for name in ("decision.json", "registry.json"):
        (repro / "reports/promote" / name).unlink()
    out = dvc(repro, "repro", "promote").stdout
    assert "Running stage 'promote'" in out and "run-cache" not in out, out
    assert str(client.get_model_version_by_alias("defect-detection", "champion").version) == champion


def test_plots_show_renders_offline(repro: Path):
    """Factory networks are often offline: every plot is an image the page embeds, no charting library."""
    dvc(repro, "plots", "show", "-o", "plots_html")
    html = (repro / "plots_html/index.html").read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html
    images = [line for line in html.splitlines() if "<img" in line]
    assert len(images) >= 10, html[:2000]
    assert any("loss.png" in line for line in images) and any("confusion_matrix.png" in line for line in images)


def test_an_experiment_compares_in_a_120_column_table(repro: Path):
    """The user's loop: change one param, `dvc exp run`, compare with `dvc exp show --only-changed`."""
    git = {"cwd": repro, "check": True, "capture_output": True}
    subprocess.run(["git", "add", "-A"], **git)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline"], **git)
    dvc(repro, "exp", "run", "-n", "shorter", "-S", "train.epochs=2")

    def exp_show(columns: int) -> list[str]:  # DVC fits its table to the terminal, folding columns from the right
        env = venv_env() | {"COLUMNS": str(columns)}
        cmd = [sys.executable, "-m", "dvc", "exp", "show", "--only-changed", "--no-pager"]
        proc = subprocess.run(cmd, cwd=repro, env=env, capture_output=True, text=True, timeout=300, check=True)
        return proc.stdout.splitlines()

    def header(table: list[str]) -> list[str]:
        return next(line for line in table if "Experiment" in line).split()

    headline = {"accuracy", "defect_recall", "false_alarm_rate", "champion", "train.epochs"}
    changed = headline & set(header(exp_show(1000)))  # the headline columns that differ between the rows
    assert "train.epochs" in changed
    table = exp_show(120)
    assert max(map(len, table)) <= 120 and any("shorter" in line for line in table), "\n".join(table)
    assert changed <= set(header(table)), "\n".join(table)  # each shown whole, not folded into "…"
