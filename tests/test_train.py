"""Training: a killed run resumes from its last checkpoint and ends with the same weights."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import checkpoint
from tests.conftest import ROOT, run_stages_in, tiny_params, venv_env

PARAMS = tiny_params(**{"model.name": "test_efficientnet"})
PARAMS["train"]["epochs"] = 4


def run_train(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "stages/train.py")],
        cwd=workdir,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def weights(path: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(path)["model"]


@pytest.fixture(scope="module")
def uninterrupted(prepared_project, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("straight")
    shutil.copytree(prepared_project, work, dirs_exist_ok=True)
    run_stages_in(work, PARAMS, ["train"])
    return work


def test_killed_training_resumes_to_identical_weights(prepared_project, uninterrupted, tmp_path):
    shutil.copytree(prepared_project, tmp_path, dirs_exist_ok=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS, sort_keys=False))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "stages/train.py")],
        cwd=tmp_path,
        env=venv_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    last = tmp_path / "models/train/checkpoints/last.pt"
    deadline = time.time() + 300
    while not last.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ckpt = checkpoint.load(last)
    assert ckpt is not None and ckpt["epoch"] < PARAMS["train"]["epochs"], "the run finished before it was killed"
    resumed = run_train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from models/train/checkpoints/last.pt after epoch {ckpt['epoch']}" in resumed.stderr
    a, b = weights(uninterrupted / "models/train/model.pt"), weights(tmp_path / "models/train/model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The resumed run reports every epoch and continued the MLflow run the killed one had opened.
    assert (tmp_path / "reports/train/history.csv").read_text().count("\n") == PARAMS["train"]["epochs"] + 1
    assert json.loads((tmp_path / "models/train/run.json").read_text())["run_id"] == ckpt["run_id"]


def test_checkpoint_of_other_params_is_not_resumed_silently(uninterrupted, tmp_path):
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    changed = tiny_params(**{"model.name": "test_efficientnet"})
    changed["train"].update(epochs=4, lr=0.001)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
    proc = run_train(tmp_path)
    assert proc.returncode == 0
    assert "was trained on other params or data" in proc.stderr and "starting fresh" in proc.stderr


def test_corrupt_checkpoint_is_reported_not_fatal(tmp_path, caplog):
    path = tmp_path / "last.pt"
    checkpoint.save_atomic({"version": checkpoint.CHECKPOINT_VERSION, "x": torch.ones(3)}, path)
    assert torch.equal(checkpoint.load(path)["x"], torch.ones(3))
    path.write_bytes(path.read_bytes()[:50])
    assert checkpoint.load(path) is None
    assert "unreadable" in caplog.text
