"""The closed loop, end to end, as the README walks it:

pipeline -> runner serves the champion -> uncertain line images fill the review queue -> a person labels
them -> `defect ingest` adds them as a batch -> `dvc exp run` retrains from the champion's weights ->
promote moves the champion only by the rules -> the runner hot-reloads whatever is champion now.
Every step is real: DVC, a SQLite MLflow store and registry, HTTP requests to `defect-runner serve`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline.config import params_from_dict
from pipeline.data.synthetic import generate
from pipeline.registry.promote import decide
from tests.conftest import copy_project, tiny_params, venv_env
from tests.serving_helpers import Server

pytestmark = pytest.mark.slow  # runs pipeline stages, servers or trainings: left out of `make test-fast`


def sh(cwd: Path, *cmd: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=venv_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def commit(project: Path, message: str) -> None:
    """`dvc exp run` works from git commits: the project (and later the new batch's .dvc file) is committed."""
    who = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", message]):
        subprocess.run(cmd, cwd=project, check=True, env=venv_env() | who)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    project = copy_project(tmp_path_factory.mktemp("loop"))
    p = tiny_params(**{"model.name": "test_efficientnet"})
    p["train"].update(epochs=3, init_from="champion")
    p["benchmark"].update(rounds=1, http_seconds=0.3, repeats=3)
    (project / "params.yaml").write_text(json.dumps(p))  # JSON is YAML
    commit(project, "project")
    sh(project, sys.executable, "-m", "dvc", "repro")
    return project


def test_the_loop_from_line_images_back_to_a_served_champion(project, tmp_path):
    params = params_from_dict(json.loads((project / "params.yaml").read_text()))
    name = params.promote.model_name
    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    first = client.get_model_version_by_alias(name, "champion")
    assert str(first.version) == "1"

    # The runner on the line serves the champion from the registry and queues what it is unsure about.
    review = tmp_path / "review"
    server = Server(
        f"models:/{name}@champion",
        "--tracking-uri",
        uri,
        "--review-dir",
        str(review),
        "--review-margin",
        "0.3",
        "--review-min-confidence",
        "0.9",
        token=None,
        env={"DEFECT_RUNNER_CACHE": str(tmp_path / "cache")},
    )
    try:
        line = tmp_path / "line"
        records = generate(line, tmp_path / "line_masks", {"ok": 12, "scratch": 6, "spot": 6, "crack": 6}, 64, 3, 99)
        truth = {Path(r["path"]).name: r["label"] for r in records}
        for r in records:
            path = line / r["path"]
            files = {"image": (path.name, path.read_bytes(), "image/png")}
            resp = server.post(f"/v2/models/{name}/classify", files=files)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model_version"] == "1"
        queued = [json.loads(x) for x in (review / "queue.jsonl").read_text().splitlines()]
        assert queued, "the tiny model is unsure about many images; none reached the review queue"

        # A person labels the queue: each image into the folder of its true class (the test knows the truth).
        labeled = tmp_path / "labeled"
        for row in queued:
            label = truth[row["filename"]]
            (labeled / label).mkdir(parents=True, exist_ok=True)
            shutil.move(review / row["review"], labeled / label / row["filename"])
        out = sh(project, sys.executable, "-m", "pipeline.cli", "ingest", str(labeled), "--name", "line-1")
        assert f"{len(queued)} images added" in out

        # Retrain as an experiment: warm start from the champion, then promote by the rules.
        commit(project, "batch line-1")
        sh(project, sys.executable, "-m", "dvc", "exp", "run", "-n", "retrain-line-1")
        d = json.loads((project / "reports/promote/decision.json").read_text())
        assert d["champion_before"]["version"] == "1" and d["challenger"]["version"] == "2"
        expected, _ = decide(
            d["challenger"],
            d["champion_before"],
            params.promote.rules,
            params.promote.promote_on_tie,
            params.promote.refuse_false_alarm_rate,
        )
        assert d["promoted"] is expected
        champion = str(client.get_model_version_by_alias(name, "champion").version)
        assert champion == ("2" if expected else "1")

        # The new run tells the whole story: named after the experiment, warm-started from version 1,
        # trained on the new batch, compared with the champion.
        run = client.get_run(d["challenger"]["run_id"])
        assert run.info.run_name.startswith("retrain-line-1-")
        assert run.data.tags["dvc.exp.name"] == "retrain-line-1"
        assert "version 1" in run.data.tags["init_from"] and run.data.tags["init_from.run_id"] == first.run_id
        assert run.data.tags["promote.compared_with"].startswith("version 1")
        assert run.data.metrics["data_accepted"] > client.get_run(first.run_id).data.metrics["data_accepted"]
        rows = sh(project, sys.executable, "-m", "dvc", "exp", "show", "--csv").splitlines()
        assert any(r.startswith("retrain-line-1,") for r in rows), rows[:5]

        # The runner picks up whatever is champion now, without a restart.
        resp = server.post(f"/v2/repository/models/{name}/load")
        assert resp.status_code == 200, resp.text
        path = line / records[0]["path"]
        resp = server.post(f"/v2/models/{name}/classify", files={"image": (path.name, path.read_bytes(), "image/png")})
        assert resp.json()["model_version"] == champion
    finally:
        server.stop()
