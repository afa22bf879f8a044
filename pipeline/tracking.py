"""MLflow: one run per trained model. Train opens it; evaluate, export and benchmark add to it.

The run id travels in ``models/train/run.json`` (a DVC output of train), so a later stage that DVC
re-runs logs into the run of the model it works on instead of creating an orphan run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from pipeline.config import MlflowConfig

log = logging.getLogger(__name__)


def configure(cfg: MlflowConfig) -> str:
    """Point MLflow at the store (``MLFLOW_TRACKING_URI`` in the environment wins) and the experiment."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(cfg.experiment)
    if exp is None:
        artifact_location = None
        if uri.startswith("sqlite:"):  # keep artifacts beside the local store, not wherever the cwd is
            artifact_location = Path("mlartifacts").resolve().as_uri()
        exp_id = mlflow.create_experiment(
            cfg.experiment,
            artifact_location=artifact_location,
            # MLflow 3 opens GenAI views by default; this tag makes the UI show the training runs table.
            tags={"mlflow.experimentKind": "custom_model_development"},
        )
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def git_info() -> dict[str, str]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"git.commit": commit or "unknown", "git.dirty": str(dirty).lower()}


def dvc_lock_hashes(path: Path = Path("dvc.lock")) -> dict[str, str]:
    """md5 of each stage's outputs as recorded in dvc.lock: the data lineage of this run."""
    if not path.is_file():
        return {}
    import yaml

    lock = yaml.safe_load(path.read_text()) or {}
    tags = {}
    for stage, body in (lock.get("stages") or {}).items():
        for out in body.get("outs") or []:
            if "md5" in out:
                tags[f"dvc.{stage}.{out['path']}"] = out["md5"]
    return tags


def start_run(
    cfg: MlflowConfig, run_id: str | None = None, run_name: str | None = None, tags: dict[str, Any] | None = None
) -> mlflow.ActiveRun:
    configure(cfg)
    if run_id:
        try:
            mlflow.get_run(run_id)
            return mlflow.start_run(run_id=run_id)
        except MlflowException:
            # The store was reset or the tracking URI changed since the checkpoint was written: the
            # training itself is intact, so go on in a new run instead of losing the work.
            log.warning(
                "MLflow run %s is not in %s any more: continuing in a new run", run_id, mlflow.get_tracking_uri()
            )
    name = run_name or os.environ.get("DVC_EXP_NAME")
    return mlflow.start_run(run_name=name, tags=tags)


def read_run_id(path: Path) -> str:
    return json.loads(path.read_text())["run_id"]


def resume_run(cfg: MlflowConfig, run_file: Path) -> mlflow.ActiveRun:
    """Continue the run of the model that ``run_file`` (written by train) belongs to."""
    return start_run(cfg, run_id=read_run_id(run_file))
