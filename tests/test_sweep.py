"""`defect sweep`: levers measured over seeds through real `dvc repro` runs, reported in sweeps/ and MLflow."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipeline.config import ConfigError
from pipeline.sweep import load_sweep, params_changed, plan
from tests.conftest import ROOT, copy_project, load_default_params, tiny_params, venv_env


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sweep(project: Path, levers: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "sweep", levers],
        cwd=project, env=venv_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A project whose tiny sweep ran: the default and a two-epoch lever, one seed each."""
    project = copy_project(tmp_path_factory.mktemp("sweep"))
    write(project / "params.yaml", tiny_params(**{"model.name": "test_efficientnet"}))
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    levers = {
        "name": "tiny",
        "seeds": [3],
        "levers": {"default": {}, "two epochs": {"train.epochs": 2}, "two members": {"train.ensemble": 2}},
    }
    write(project / "sweeps/tiny.yaml", levers)
    return project, sweep(project, "sweeps/tiny.yaml")


def test_each_lever_runs_the_pipeline_with_its_params_and_the_table_reports_its_figures(swept):
    project, proc = swept
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/3] default, seed 3" in proc.stdout and "[2/3] two epochs, seed 3" in proc.stdout
    out = project / "sweeps/tiny"
    for lever, epochs in (("default", 1), ("two-epochs", 2)):
        run = out / lever / "seed3"
        used = yaml.safe_load((run / "params.yaml").read_text())
        assert used["train"]["seed"] == 3 and used["train"]["epochs"] == epochs
        history = (run / "reports/train/history.csv").read_text().strip().splitlines()
        assert len(history) == 1 + epochs  # the lever reached the training: one row per epoch
        assert (run / "reports/evaluate/roc.png").stat().st_size > 0
    rows = json.loads((out / "runs.json").read_text())
    evaluation = json.loads((out / "two-epochs/seed3/reports/evaluate/metrics.json").read_text())
    two = next(r for r in rows if r["lever"] == "two epochs")
    assert two["recall_at_far"] == evaluation["defect_recall_at_far_threshold"]
    assert two["auc"] == evaluation["roc_auc"] and two["accuracy"] == evaluation["accuracy"]
    # an ensemble's training time is its members' together (its own metrics.json has no epoch count)
    members = json.loads((out / "two-members/seed3/reports/train/metrics.json").read_text())["members"]
    assert len(members) == 2 and all(m["epochs_run"] == 1 for m in members)
    each = [m["epoch_images"] / m["train_img_s"] for m in members]
    assert next(r for r in rows if r["lever"] == "two members")["train_s"] == pytest.approx(sum(each), abs=0.2)
    table = (out / "summary.md").read_text()
    assert f'| two epochs | `{{"train.epochs": 2}}` | {two["recall_at_far"]:.2f} ({two["far"]:.2f})' in table
    assert (out / "levers.png").stat().st_size > 0


def test_params_yaml_is_put_back_after_the_sweep(swept):
    project, _ = swept
    assert yaml.safe_load((project / "params.yaml").read_text()) == tiny_params(**{"model.name": "test_efficientnet"})
    # byte for byte what was staged before the sweep
    assert subprocess.run(["git", "diff", "--quiet", "params.yaml"], cwd=project).returncode == 0


def test_the_sweep_is_an_mlflow_run_with_the_trainings_nested_under_it(swept):
    project, _ = swept
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("defect-detection").experiment_id)
    parent = next(r for r in runs if r.info.run_name == "sweep tiny")
    assert {"sweep/summary.md", "sweep/summary.csv", "sweep/levers.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "sweep")
    }
    assert "two-epochs.recall_at_far_mean" in parent.data.metrics
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["sweep.lever"] for r in children) == ["default", "two epochs", "two members"]
    assert all(r.data.params["train.epochs"] in ("1", "2") for r in children)  # the training runs themselves


def test_a_second_sweep_keeps_finished_runs(swept):
    project, _ = swept
    proc = sweep(project, "sweeps/tiny.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("done before, kept") == 3 and "dvc repro evaluate (log" not in proc.stdout


def test_a_finished_run_with_other_params_names_the_keys_that_make_it_run_again(tmp_path):
    """A key params.yaml gained after a run finished (a new knob) reruns it: the sweep says which key, so an
    hour of retraining is never a surprise."""
    now = load_default_params()
    before = yaml.safe_load(yaml.safe_dump(now))
    del before["augment"]["orientation"]
    before["train"]["epochs"] = 40
    write(tmp_path / "params.yaml", before)
    changed = params_changed(tmp_path, now)
    assert 'augment.orientation: "(absent)" -> "free"' in changed
    assert f"train.epochs: 40 -> {now['train']['epochs']}" in changed and changed.count(" -> ") == 2
    write(tmp_path / "params.yaml", now)
    assert params_changed(tmp_path, now) == ""


def test_a_lever_naming_a_missing_param_stops_before_anything_runs(tmp_path):
    levers = write(tmp_path / "l.yaml", {"seeds": [0], "levers": {"default": {}, "typo": {"train.epochz": 3}}})
    with pytest.raises(ConfigError, match=r"levers\.typo: train\.epochz: params.yaml has no such key"):
        plan(load_sweep(levers), load_default_params())
    bad_value = write(tmp_path / "v.yaml", {"levers": {"x": {"train.epochs": "many"}}})
    with pytest.raises(ConfigError, match=r"levers\.x \(seed 0\).*train\.epochs"):
        plan(load_sweep(bad_value), load_default_params())
    with pytest.raises(ConfigError, match="seeds: expected a list of integers"):
        load_sweep(write(tmp_path / "s.yaml", {"seeds": "0-2", "levers": {"a": {}}}))
    with pytest.raises(ConfigError, match="not found"):
        load_sweep(tmp_path / "absent.yaml")


@pytest.mark.parametrize("levers", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_levers_file_plans_against_the_default_params(levers):
    """The sweeps the README points at (the measured levers of the tile docs) still name real keys and
    valid values of params.yaml: a renamed param fails here, not an hour into someone's sweep."""
    runs = plan(load_sweep(levers), load_default_params())
    assert runs and all(p["train"]["seed"] == seed for _, seed, p in runs)


def test_ensemble_mix_scores_the_swept_models_as_the_evaluate_stage_does(swept):
    """experiments/ensemble_mix.py: a one-member "ensemble" of a run reproduces that run's evaluate figures
    (the same model from MLflow, the same val-chosen cut), and a mix of two levers is scored too."""
    project, _ = swept
    env = venv_env()
    env["PYTHONPATH"] = str(project)
    proc = subprocess.run(
        [sys.executable, "experiments/ensemble_mix.py", "sweeps/tiny", "--mix", "two epochs:1",
         "--mix", "default:1,two epochs:1", "--out", "mix.md"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    two = json.loads((project / "sweeps/tiny/two-epochs/seed3/result.json").read_text())
    summary, layouts = (project / "mix.md").read_text().split("\n\n")
    rows = {line.split(" | ")[0].strip("| "): line for line in summary.splitlines()}
    assert f"| two epochs:1 | 1 | {two['recall_at_far']:.2f} ({two['recall_at_far']:.2f}) |" in rows["two epochs:1"]
    assert f"| {two['auc']:.3f} |" in rows["two epochs:1"] and f"| {two['accuracy']:.2f} |" in rows["two epochs:1"]
    assert rows["default:1,two epochs:1"].startswith("| default:1,two epochs:1 | 1 | ")
    # the layout train.ensemble_members would train for train.seed 3: only the one-lever mix has its seeds
    assert "| two epochs:1 | 3 | two epochs 3 |" in layouts and "default 3, two epochs 4" not in layouts
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("defect-detection").experiment_id)
    logged = next(r for r in runs if r.info.run_name == "ensemble mix")
    assert logged.data.metrics["two-epochs-1.auc_mean"] == pytest.approx(two["auc"])
    assert [a.path for a in client.list_artifacts(logged.info.run_id, "ensemble_mix")] == ["ensemble_mix/mix.md"]
    # counting val OK images instead of parts: every synthetic image is its own part, so the same cut
    by_images = subprocess.run(
        [sys.executable, "experiments/ensemble_mix.py", "sweeps/tiny", "--mix", "two epochs:1", "--val-count",
         "images", "--out", "images.md"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert by_images.returncode == 0, by_images.stderr[-2000:]
    assert rows["two epochs:1"] in (project / "images.md").read_text()
    bad = subprocess.run(
        [sys.executable, "experiments/ensemble_mix.py", "sweeps/tiny", "--mix", "gamma only:1"],
        cwd=project, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "'gamma only' has 0 finished runs" in bad.stderr


def test_ensemble_mix_scores_a_member_of_another_input_size_on_the_same_images_at_its_size(swept, tmp_path):
    """--prepared-at SIZE=DIR: a member trained at another prepare.image_size is scored on the same split
    prepared at that size (so ensembles may mix input sizes); a missing size or other images stop with the
    option to give."""
    from pipeline.config import params_from_dict
    from pipeline.prepare import prepare
    from pipeline.validate import read_manifest

    project, _ = swept
    env = venv_env()
    env["PYTHONPATH"] = str(project)
    params = params_from_dict(tiny_params(**{"prepare.image_size": 48}))
    manifest = read_manifest(project / "data/validated/manifest.csv")
    at48 = tmp_path / "prepared48"
    prepare(manifest, project / "data/raw/images", sorted({r["label"] for r in manifest}), params.data.ok_class,
            params.data.channels, params.prepare, at48)  # fmt: skip
    # the same sweep, its 'two epochs' model now said to be trained at 48 px (the network takes any size)
    folder = tmp_path / "sweeps/tiny"
    shutil.copytree(project / "sweeps/tiny", folder)
    used = folder / "two-epochs/seed3/params.yaml"
    changed = yaml.safe_load(used.read_text())
    changed["prepare"]["image_size"] = 48
    write(used, changed)

    def mix(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "experiments/ensemble_mix.py", str(folder), "--mix", "two epochs:1", *extra],
            cwd=project, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    missing = mix("--out", str(tmp_path / "x.md"))
    assert missing.returncode != 0 and "--prepared-at 48=DIR" in missing.stderr
    mixed = mix("--prepared-at", f"48={at48}", "--out", str(tmp_path / "mixed.md"))
    assert mixed.returncode == 0, mixed.stderr[-2000:]
    # scored at 48 px: the same row as when the 48 px split is the only data (the labels and cut are shared)
    alone = mix("--prepared", str(at48), "--out", str(tmp_path / "alone.md"))
    assert alone.returncode == 0, alone.stderr[-2000:]
    rows = (tmp_path / "alone.md").read_text().splitlines()
    row = next(line for line in rows if line.startswith("| two epochs:1 | 1 |"))
    assert row in (tmp_path / "mixed.md").read_text()
    other = tmp_path / "other"
    shutil.copytree(at48, other)
    with np.load(other / "val.npz") as z:
        arrays = dict(z)
    arrays["labels"] = arrays["labels"][::-1].copy()
    np.savez(other / "val.npz", **arrays)
    wrong = mix("--prepared-at", f"48={other}", "--out", str(tmp_path / "y.md"))
    assert wrong.returncode != 0 and "its val split holds other images or labels" in wrong.stderr


def test_ensemble_mix_redraw_on_the_real_partition_gives_the_splits_own_figures(swept, monkeypatch):
    """--redraw N re-draws which held-out parts set the cut; drawn as val and test really are, it must give
    the val-cut recall, the budget check and the oracle of the real split, and the table gains the column."""
    import importlib.util

    project, _ = swept
    spec = importlib.util.spec_from_file_location("ensemble_mix", ROOT / "experiments/ensemble_mix.py")
    mix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mix)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}")
    runs = mix.finished_runs([project / "sweeps/tiny"])
    members = [("default", 3), ("two epochs", 3)]
    probs = mix.score_runs(runs, members, project / "data/prepared")
    judge = mix.Judge(project / "data/prepared", 0.03)
    real = judge([probs[m] for m in members])
    as_split = np.r_[np.ones(len(judge.y_val), bool), np.zeros(len(judge.y_test), bool)]
    again = judge.redrawn([probs[m] for m in members], [as_split])
    assert again["recall"] == pytest.approx(real["recall"]) and again["oracle"] == pytest.approx(real["oracle"])
    assert again["within"] == float(real["far"] <= 0.03 + 1e-9)
    draws = judge.draws(20)
    assert len(draws) == 20 and all(d.shape == as_split.shape for d in draws)
    assert 0.4 < np.mean([d.mean() for d in draws]) < 0.8  # about the val split's share on the cut side
    env = venv_env()
    env["PYTHONPATH"] = str(project)
    proc = subprocess.run(
        [sys.executable, "experiments/ensemble_mix.py", "sweeps/tiny", "--mix", "two epochs:1", "--redraw", "20",
         "--out", "redraw.md"],
        cwd=project, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    header, _, row = (project / "redraw.md").read_text().splitlines()[:3]
    assert header.endswith("re-drawn splits (20): recall, within 3%, oracle |")
    assert row.count("|") == header.count("|") == 9
