"""`defect sweep`: levers measured over seeds as experiments in DVC's own queue, reported in sweeps/ and MLflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from pipeline.config import ConfigError
from pipeline.sweep import (
    Sweep,
    experiment_name,
    load_sweep,
    params_changed,
    plan,
    queue,
    show,
    summarize,
    write_table,
)
from tests.conftest import ROOT, copy_project, load_default_params, tiny_params, venv_env

pytestmark = pytest.mark.slow  # runs pipeline stages, servers or trainings: left out of `make test-fast`

GAMMA_ONLY = [
    {"name": "Sequential", "p": 0.5, "transforms": [{"name": "RandomGamma", "gamma_limit": [70, 150], "p": 0.5}]}
]


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def git(project: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(cmd, cwd=project, check=True, capture_output=True, text=True).stdout


def dvc(project: Path, *args: str) -> str:
    cmd = [sys.executable, "-m", "dvc", *args]
    return subprocess.run(cmd, cwd=project, env=venv_env(), check=True, capture_output=True, text=True).stdout


def experiments(project: Path) -> dict[str, dict]:
    """What `dvc exp show --json` says of each experiment, by name, and the params.yaml it ran with."""
    out = {}
    for baseline in json.loads(dvc(project, "exp", "show", "--json")):
        for entry in baseline.get("experiments") or []:
            rev = entry["revs"][0]
            metrics = {path: m.get("data") for path, m in rev["data"]["metrics"].items()}
            params = yaml.safe_load(git(project, "show", f"{rev['rev']}:params.yaml"))
            reports = {  # the detail the headline metrics files stand for, as the experiment's commit holds it
                path: json.loads(git(project, "show", f"{rev['rev']}:{path}"))
                for path in ("reports/train/metrics.json", "reports/evaluate/metrics.json")
            }
            out[rev["name"]] = {"state": entry["executor"]["state"], "metrics": metrics, "params": params} | {
                "reports": reports
            }
    return out


def sweep(project: Path, levers: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "sweep", levers],
        cwd=project,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A committed project whose tiny sweep ran: the default and a lever of two epochs, gamma only, seed 3."""
    project = copy_project(tmp_path_factory.mktemp("sweep"))
    write(project / "params.yaml", tiny_params(**{"model.name": "test_efficientnet"}))
    lever = {"train.epochs": 2, "augment.policy": GAMMA_ONLY}
    levers = {"name": "tiny", "seeds": [3], "levers": {"default": {}, "two epochs, gamma only": lever}}
    write(project / "sweeps/tiny.yaml", levers)
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "tiny project")  # experiments are based on a commit
    return project, sweep(project, "sweeps/tiny.yaml")


def test_each_lever_and_seed_is_a_dvc_experiment_that_ran_with_its_params(swept):
    project, proc = swept
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/2] default, seed 3: queued (experiment tiny-default-s3)" in proc.stdout
    assert "dvc exp run --run-all" in proc.stdout
    exps = experiments(project)
    assert set(exps) == {"tiny-default-s3", "tiny-two-epochs-gamma-only-s3"}
    for name, epochs, policy in (
        ("tiny-default-s3", 1, load_default_params()["augment"]["policy"]),
        ("tiny-two-epochs-gamma-only-s3", 2, GAMMA_ONLY),
    ):
        e = exps[name]
        assert e["state"] == "success"
        assert e["params"]["train"]["seed"] == 3 and e["params"]["train"]["epochs"] == epochs
        assert e["params"]["augment"]["policy"] == policy
        # the lever reached the training: one epoch row each, in the experiment's own metrics
        assert e["reports"]["reports/train/metrics.json"]["epochs_run"] == epochs
        assert e["metrics"]["reports/evaluate/headline.json"]["accuracy"] == round(
            e["reports"]["reports/evaluate/metrics.json"]["accuracy"], 4
        )
        # the copy DVC ran it in logged to the project's MLflow store, not to one deleted with the copy
        assert e["params"]["mlflow"]["tracking_uri"] == f"sqlite:///{project / 'mlflow.db'}"


def test_the_workspace_is_not_run_in_and_params_yaml_stays_as_it_was(swept):
    project, _ = swept
    assert subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "params.yaml"], cwd=project).returncode == 0
    assert not (project / "models").exists() and not (project / "data").exists()  # the runs were DVC's copies


def test_the_table_pairs_each_lever_with_the_reference_from_the_experiments_figures(swept):
    project, _ = swept
    exps = experiments(project)
    ref = exps["tiny-default-s3"]["reports"]["reports/evaluate/metrics.json"]
    two = exps["tiny-two-epochs-gamma-only-s3"]["reports"]["reports/evaluate/metrics.json"]
    rows = {r["experiment"]: r for r in json.loads((project / "sweeps/tiny/runs.json").read_text())}
    assert rows["tiny-two-epochs-gamma-only-s3"]["recall_at_far"] == two["defect_recall"]
    assert rows["tiny-two-epochs-gamma-only-s3"]["auc"] == two["roc_auc"]
    recall, far = two["defect_recall"], two["false_alarm_rate"]
    paired = recall - ref["defect_recall"]
    table = (project / "sweeps/tiny/summary.md").read_text()
    changes = json.dumps(load_sweep(project / "sweeps/tiny.yaml").levers["two epochs, gamma only"])
    assert (
        f"| two epochs, gamma only | `{changes}` | {recall:.2f} ({far:.2f}) | {recall:.2f} | {paired:+.2f} (1) |"
        in table
    )
    assert (project / "sweeps/tiny/levers.png").stat().st_size > 0


def test_the_sweep_is_an_mlflow_run_with_the_experiments_trainings_nested_under_it(swept):
    project, _ = swept
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs(client.get_experiment_by_name("defect-detection").experiment_id)
    parent = next(r for r in runs if r.info.run_name == "sweep tiny")
    assert {"sweep/summary.md", "sweep/summary.csv", "sweep/levers.png", "sweep/runs.json"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "sweep")
    }
    assert "two-epochs-gamma-only.recall_vs_reference" in parent.data.metrics
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["sweep.experiment"] for r in children) == [
        "tiny-default-s3",
        "tiny-two-epochs-gamma-only-s3",
    ]
    assert sorted(r.data.params["train.epochs"] for r in children) == ["1", "2"]  # the training runs themselves


def test_a_second_sweep_keeps_the_finished_experiments(swept):
    project, _ = swept
    proc = sweep(project, "sweeps/tiny.yaml")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("done before, kept") == 2 and "--run-all" not in proc.stdout
    assert len(experiments(project)) == 2


def test_the_table_pairs_by_seed_over_the_seeds_both_finished(tmp_path):
    """A lever is compared seed by seed with the reference, only where both finished: seed noise on small
    data is larger than most levers, so an unpaired mean over other seeds would mislead."""
    sw = Sweep("pairs", {}, [0, 1, 2], {"default": {}, "lever": {"train.epochs": 2}})

    def row(lever, seed, recall, rc=0):
        return {"lever": lever, "seed": seed, "rc": rc, "recall_at_far": recall, "far": 0.01, "auc": 0.9}

    rows = [
        row("default", 0, 0.5),
        row("default", 1, 0.9),
        row("default", 2, 0.6),
        row("lever", 0, 0.7),
        row("lever", 1, None, rc=1),
        row("lever", 2, 0.7),
    ]
    table = summarize(sw, rows, 0.03)
    lever = table[1]
    assert lever["recall_vs_reference"] == pytest.approx(((0.7 - 0.5) + (0.7 - 0.6)) / 2)  # seed 1 failed
    assert (lever["paired_seeds"], lever["seeds"], lever["failed"]) == (2, 2, 1)
    assert table[0]["recall_vs_reference"] != table[0]["recall_vs_reference"]  # the reference: no pair (NaN)
    write_table(table, tmp_path, sw, 0.03)
    assert (
        '| lever | `{"train.epochs": 2}` | 0.70 (0.01) / 0.70 (0.01) (1 failed) | 0.70 | +0.15 (2) |'
        in (tmp_path / "summary.md").read_text()
    )


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """A committed git + DVC repo holding the default params.yaml and a stage that reads them (never run)."""
    git(tmp_path, "init", "-q")
    dvc(tmp_path, "init", "-q")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    write(tmp_path / "dvc.yaml", {"stages": {"s": {"cmd": "true", "params": ["data", "train", "augment", "tiles"]}}})
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "scratch")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_queued_experiments_hold_exactly_the_planned_params(scratch):
    """Lists of mappings, mappings whose keys hold dots, quotes and spaces in a path: each goes through
    `dvc exp run --queue -S` (Hydra's grammar) and the queued params.yaml reads back as planned."""
    now = yaml.safe_load((scratch / "params.yaml").read_text())
    sw = Sweep(
        "odd",
        {"data.source": "it's a folder/with space"},
        [0],
        {
            "default": {},
            "gamma only": {"augment.policy": GAMMA_ONLY, "tiles.use": False},
            "members": {
                "train.ensemble": 3,
                "train.ensemble_members": [{"train.epochs": 40}, {}, {"augment.policy": GAMMA_ONLY}],
            },
            "short tiles": {"tiles.recipe": {"train.epochs": 3}},
        },
    )
    runs = plan(sw, now)
    assert queue(sw, runs, now, until="") == {"kept": 0, "pending": 0, "queue": 4}
    found = show()
    for lever, seed, p in runs:
        (e,) = found[experiment_name(sw, lever, seed)]
        held = yaml.safe_load(git(scratch, "show", f"{e.rev}:params.yaml"))
        assert e.state == "queued" and held == p and params_changed(held, p) == ""
    assert held["tiles"]["recipe"] == {"train.epochs": 3}  # replaced, not merged into the default's recipe
    assert runs[0][2]["data"]["source"] == str(scratch / "it's a folder/with space")  # made absolute
    assert yaml.safe_load((scratch / "params.yaml").read_text()) == now  # the workspace's file is as it was


def test_a_value_the_stages_would_read_otherwise_is_refused_and_leaves_the_queue(scratch):
    """DVC writes a float under 1e-4 as 1e-05, which the stages' YAML reader takes for a string."""
    now = yaml.safe_load((scratch / "params.yaml").read_text())
    sw = Sweep("tiny-decay", {}, [0], {"decay": {"train.weight_decay": 0.00001}})
    with pytest.raises(SystemExit, match=r'tiny-decay-decay-s0: train.weight_decay: "1e-05" -> 1e-05'):
        queue(sw, plan(sw, now), now, until="")
    assert show() == {}


def test_a_finished_run_with_other_params_names_the_keys_that_make_it_run_again():
    """A key params.yaml gained after a run finished (a new knob) reruns it: the sweep says which key, so an
    hour of retraining is never a surprise."""
    now = load_default_params()
    before = yaml.safe_load(yaml.safe_dump(now))
    del before["augment"]["orientation"]
    before["train"]["epochs"] = 40
    changed = params_changed(before, now)
    assert 'augment.orientation: "(absent)" -> "free"' in changed
    assert f"train.epochs: 40 -> {now['train']['epochs']}" in changed and changed.count(" -> ") == 2
    assert params_changed(now, now) == ""


def test_a_lever_naming_a_missing_param_stops_before_anything_is_queued(tmp_path):
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
    """The levers files the README points at still name real keys and valid values of params.yaml: a renamed
    param fails here, not an hour into someone's sweep."""
    runs = plan(load_sweep(levers), load_default_params(), ROOT)
    assert runs and all(p["train"]["seed"] == seed for _, seed, p in runs)
    assert all(Path(p["data"]["source"]).is_absolute() or p["data"]["source"] == "synthetic" for _, _, p in runs)
