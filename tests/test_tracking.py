"""MLflow logging survives a tracking server that goes away: nothing is lost, the stage goes on.

Real `mlflow server` processes (SQLite backend, served artifacts) are started, killed and restarted
on the same port; the client side is the pipeline's own ``pipeline.tracking``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipeline import tracking
from pipeline.config import MlflowConfig, params_from_dict
from tests.conftest import tiny_params

pytestmark = pytest.mark.slow  # runs pipeline stages, servers or trainings: left out of `make test-fast`


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrackingServer:
    """``mlflow server`` on loopback; ``stop()`` kills it like a crash or a network cut would look."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> TrackingServer:
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}"]
        cmd += ["--artifacts-destination", str(self.root / "artifacts"), "--workers", "1"]
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 - the server process owns it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"mlflow server did not come up:\n{(self.root / 'server.log').read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole group: gunicorn/uvicorn workers too
            self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path):
    (tmp_path / "server").mkdir()
    srv = TrackingServer(tmp_path / "server", free_port()).start()
    yield srv
    srv.stop()


@pytest.fixture
def offline_fast(monkeypatch):
    """One quick try per call against a dead server (the stage's own defaults allow 2 retries)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def test_logging_is_buffered_while_the_server_is_down_and_sent_when_it_is_back(
    server, tmp_path, monkeypatch, offline_fast, capsys
):
    monkeypatch.chdir(tmp_path)
    cfg = MlflowConfig(tracking_uri=server.uri, experiment="buffer-test")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG fake plot bytes")
    with tracking.open_run(cfg, run_name="outage") as run:
        run.log_metrics({"loss": 1.0}, step=1)
        server.stop()  # the server dies mid-run
        run.log_metrics({"loss": 0.5}, step=2)
        run.log_metrics({"loss": 0.25}, step=3)
        run.set_tags({"stage": "train"})
        run.log_artifacts(tmp_path / "plot.png", "train")
        (tmp_path / "plot.png").write_bytes(b"changed after logging")  # the buffer holds the logged bytes
    out = capsys.readouterr().out
    assert "could not reach" in out and ".mlflow-buffer" in out, out
    buffer = tracking.Buffer(server.uri)
    assert buffer.pending() == 5  # 2 metrics calls, tags, artifact, terminate

    server.start()  # back on the same port and store
    sent = tracking.flush_all()
    assert sent == {server.uri: (5, 0)}
    assert not buffer.dir.exists()
    client = MlflowClient(server.uri)
    history = client.get_metric_history(run.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    got = client.get_run(run.run_id)
    assert got.data.tags["stage"] == "train" and got.info.status == "FINISHED"
    local = client.download_artifacts(run.run_id, "train/plot.png", str(tmp_path / "dl"))
    assert Path(local).read_bytes() == b"\x89PNG fake plot bytes"


def test_a_new_run_on_a_dead_server_is_a_clear_error(tmp_path, monkeypatch, offline_fast):
    monkeypatch.chdir(tmp_path)
    cfg = MlflowConfig(tracking_uri=f"http://127.0.0.1:{free_port()}", experiment="nobody-home")
    with (
        pytest.raises(tracking.TrackingUnavailable, match="cannot create a run.*tracking_server.sh"),
        tracking.open_run(cfg),
    ):
        pass


def test_training_survives_the_server_dying_mid_run(server, prepared_project, tmp_path, monkeypatch, offline_fast):
    """The train stage, in process: the server is killed when epoch 1 is logged; training finishes,
    model.pt is written, and after a restart `defect mlflow-flush` delivers epochs 2..4 and the plots."""
    work = tmp_path / "work"
    shutil.copytree(prepared_project, work)
    monkeypatch.chdir(work)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    p = tiny_params(**{"model.name": "test_efficientnet"})
    p["train"]["epochs"] = 4
    p["mlflow"]["tracking_uri"] = server.uri
    params = params_from_dict(p)

    class KillAfterFirstEpoch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("epoch 1:"):
                server.stop()

    handler = KillAfterFirstEpoch()
    logging.getLogger("pipeline.training.fit").addHandler(handler)
    logging.getLogger("pipeline.training.fit").setLevel(logging.INFO)
    try:
        from pipeline.training.recipe import train

        summary = train(params, Path("data/prepared"), Path("models/train"), Path("reports/train"), Path("reports"))
    finally:
        logging.getLogger("pipeline.training.fit").removeHandler(handler)
    assert summary["epochs_run"] == 4 and Path("models/train/model.pt").is_file()
    run_id = tracking.read_run_id(Path("models/train/run.json"))
    assert tracking.Buffer(server.uri).pending() > 0

    server.start()
    assert subprocess.run([sys.executable, "-m", "pipeline.cli", "mlflow-flush"], cwd=work).returncode == 0
    client = MlflowClient(server.uri)
    steps = [m.step for m in client.get_metric_history(run_id, "val_loss")]
    assert steps == [1, 2, 3, 4]
    artifacts = {a.path for a in client.list_artifacts(run_id, "train")}
    assert {"train/loss.png", "train/history.csv"} <= artifacts
    assert [a.path for a in client.list_artifacts(run_id, "model")] == ["model/model.pt"]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    # one network: the model's run itself, named by the time (no DVC experiment here), nothing nested under it
    assert re.fullmatch(r"\d{4}-\d{4}-test_efficientnet-64px-[0-9a-f]{6}", got.info.run_name), got.info.run_name
    assert got.data.tags["recipe"].startswith("model 4 epochs x ")
    assert not client.search_runs([got.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'")


def test_an_ensemble_is_one_model_run_with_each_network_nested_under_it(
    prepared_project, tmp_path, monkeypatch, capsys
):
    """train.ensemble 2: the model's run (named after the DVC experiment) holds the params, the first member's
    curves by epoch, the recipe and model.pt; each member has its own run nested under it. The stage run
    again (DVC re-running it, nothing to train) continues the same runs and adds no curve points."""
    from pipeline.training.recipe import CURVE_METRICS, train

    work = tmp_path / "work"
    shutil.copytree(prepared_project, work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-nested")
    p = tiny_params(**{"model.name": "test_efficientnet"})
    p["train"].update(ensemble=2, epochs=2)
    p["mlflow"]["tracking_uri"] = f"sqlite:///{work / 'mlflow.db'}"
    params = params_from_dict(p)
    train(params, Path("data/prepared"), Path("models/train"), Path("reports/train"), Path("reports"))
    out = capsys.readouterr().out
    assert re.search(r"train: member-0 2 epochs x \d+ images, member-1 2 epochs x \d+ images \(", out), out
    assert re.search(r"train: member-0 epoch 1 at \d+ img/s: expected ~\d+ min", out), out

    client = MlflowClient(p["mlflow"]["tracking_uri"])
    parent_id = tracking.read_run_id(Path("models/train/run.json"))
    parent = client.get_run(parent_id)
    assert re.fullmatch(r"exp-nested-2xtest_efficientnet-64px-[0-9a-f]{6}", parent.info.run_name)
    assert parent.data.tags["dvc.exp.name"] == "exp-nested" and "mlflow.parentRunId" not in parent.data.tags
    assert parent.data.tags["recipe"].startswith("member-0 2 epochs x ")
    assert parent.data.params["model.name"] == "test_efficientnet" and "data_accepted" in parent.data.metrics
    assert parent.data.tags["git.dirty"] in ("true", "false") and "data.fingerprint" in parent.data.tags
    recipe = json.loads(Path("reports/train/recipe.json").read_text())
    assert [(r["name"], r["epochs"]) for r in recipe["runs"]] == [("member-0", 2), ("member-1", 2)]
    assert recipe["expected_minutes"] is not None and recipe["images"] == 2 * sum(
        r["images_per_epoch"] for r in recipe["runs"]
    )

    exp_id = parent.info.experiment_id
    children = client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert sorted(c.info.run_name for c in children) == ["member-0", "member-1"]
    member0 = next(c for c in children if c.info.run_name == "member-0")
    for key in CURVE_METRICS:  # the first member's curves, on the model's run too
        mine = [(m.step, m.value) for m in client.get_metric_history(parent_id, key)]
        assert mine == [(m.step, m.value) for m in client.get_metric_history(member0.info.run_id, key)], key
        assert [s for s, _ in mine] == [1, 2], key
    assert parent.data.tags["member_0.run_id"] == member0.info.run_id
    assert member0.data.params["train.seed"] == str(p["train"]["seed"])
    assert {a.path for a in client.list_artifacts(parent_id, "train")} >= {"train/recipe.json", "train/loss.png"}
    assert [a.path for a in client.list_artifacts(parent_id, "model")] == ["model/model.pt"]
    assert not client.list_artifacts(member0.info.run_id, "model")  # its network is in the model's file

    runs_before = len(client.search_runs([exp_id]))
    train(params, Path("data/prepared"), Path("models/train"), Path("reports/train"), Path("reports"))
    assert tracking.read_run_id(Path("models/train/run.json")) == parent_id
    assert len(client.search_runs([exp_id])) == runs_before
    assert [m.step for m in client.get_metric_history(parent_id, "val_loss")] == [1, 2]
