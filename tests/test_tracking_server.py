"""The shared tracking server (scripts/tracking_server.sh): PostgreSQL backend store, artifacts served over HTTP.

Starts a real server on free ports, runs the pipeline's stages against it and checks that the run, its
metrics and its artifacts came back through the server, and that the rows live in PostgreSQL.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, copy_project, tiny_params, venv_env

pytestmark = pytest.mark.slow  # runs pipeline stages, servers or trainings: left out of `make test-fast`

SCRIPT = ROOT / "scripts" / "tracking_server.sh"
OFFLINE_STAGES = ["ingest", "validate", "prepare", "augment"]
TRACKED_STAGES = ["train", "evaluate", "export"]
START_TIMEOUT_S = 400
INSTALL_HINT = "apt-get install -y postgresql (.ci/run installs it in CI)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[[], dict]]:
    """Starts the server in the background and yields ``ready()``, which waits for it and returns its details.

    The stages before train do not log to MLflow, so they run while the server starts (~30 s on 2 cores)."""
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        pytest.skip("psycopg2 is not importable: pip install -r requirements.txt (pins psycopg2-binary)")
    env = venv_env()
    check = script("check", env=env, timeout=60)
    if check.returncode == 3:
        pytest.skip(f"PostgreSQL server binaries not found: {INSTALL_HINT}; {check.stderr.strip()}")
    assert check.returncode == 0, f"tracking_server.sh check failed:\n{check.stdout}\n{check.stderr}"

    # Not pytest's tmp_path: as root the script runs PostgreSQL as the `postgres` user, which cannot
    # walk into /tmp/pytest-of-root (mode 0700). A 0755 folder directly under /tmp can be reached.
    folder = Path(tempfile.mkdtemp(prefix="mlflow-server-"))
    folder.chmod(0o755)
    pg_port, mlflow_port = free_port(), free_port()
    while mlflow_port == pg_port:
        mlflow_port = free_port()
    env.update(PG_PORT=str(pg_port), MLFLOW_PORT=str(mlflow_port))
    uri = f"http://127.0.0.1:{mlflow_port}"
    start = subprocess.Popen(
        ["bash", str(SCRIPT), "start", str(folder)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def ready() -> dict:
        out, err = start.communicate(timeout=START_TIMEOUT_S)
        if start.returncode != 0:
            logs = "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*.log")))
            pytest.fail(f"tracking_server.sh start failed ({start.returncode}):\n{err}\n{logs}")
        assert out.strip().splitlines()[-1] == f"export MLFLOW_TRACKING_URI={uri}", out
        return {"uri": uri, "pg_port": pg_port, "dir": folder}

    try:
        yield ready
    finally:
        if start.returncode is None:  # the test failed before ready(): let start finish, then stop it all
            try:
                start.communicate(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                start.kill()
        stop = script("stop", str(folder), env=env, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)
        assert stop.returncode == 0, f"tracking_server.sh stop failed:\n{stop.stderr}"


def run_stage(project: Path, stage: str, env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "stages" / f"{stage}.py")],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_pipeline_run_lives_on_the_postgres_server(start_server: Callable[[], dict], tmp_path: Path):
    import mlflow
    import psycopg2

    (tmp_path / "project").mkdir()
    project = copy_project(tmp_path / "project")
    (project / "params.yaml").write_text(
        yaml.safe_dump(tiny_params(**{"model.name": "test_efficientnet"}), sort_keys=False)
    )
    for stage in OFFLINE_STAGES:  # no MLflow in these: they run while the server starts
        run_stage(project, stage, venv_env())
    server = start_server()
    env = venv_env()  # it drops MLFLOW_TRACKING_URI; every stage from train on must log to the server
    env["MLFLOW_TRACKING_URI"] = server["uri"]
    for stage in TRACKED_STAGES:
        run_stage(project, stage, env)
    assert not (project / "mlflow.db").exists(), "a stage logged to the local SQLite store, not the server"
    leftovers = list((project / ".mlflow-buffer").glob("*/queue.jsonl"))
    assert not leftovers, f"calls that never reached the server: {leftovers}"

    run_id = json.loads((project / "models/train/run.json").read_text())["run_id"]
    client = mlflow.MlflowClient(tracking_uri=server["uri"])
    run = client.get_run(run_id)
    for metric in ("val_loss", "test_accuracy", "export_fp32_prob_max_abs_diff"):
        assert metric in run.data.metrics, f"{metric} missing from {sorted(run.data.metrics)}"

    # Served artifacts: the run's root is a proxy URI, files live under the server's artifacts folder.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri
    evaluate = {f.path for f in client.list_artifacts(run_id, "evaluate")}
    export = {f.path for f in client.list_artifacts(run_id, "export")}
    assert "evaluate/confusion_matrix.png" in evaluate, evaluate
    assert "export/model.onnx" in export, export
    assert list((server["dir"] / "artifacts").rglob("model.onnx")), "the server did not store the upload"
    downloaded = Path(client.download_artifacts(run_id, "export/model.onnx", str(tmp_path / "download")))
    assert downloaded.read_bytes() == (project / "models/export/model.onnx").read_bytes()

    # The rows are in PostgreSQL (so this cannot pass against a file or SQLite store).
    conn = psycopg2.connect(host="127.0.0.1", port=server["pg_port"], user="postgres", dbname="mlflow")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM runs WHERE run_uuid = %s", (run_id,))
            assert cur.fetchone()[0] == 1, f"run {run_id} is not in PostgreSQL's runs table"
            cur.execute("SELECT count(*) FROM latest_metrics WHERE run_uuid = %s AND key = 'test_accuracy'", (run_id,))
            assert cur.fetchone()[0] == 1
    finally:
        conn.close()
