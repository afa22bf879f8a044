"""MLflow: one run per trained model. Train opens it; evaluate, export, benchmark and promote add to it.

The model's run is the one a person compares: params, lineage, the curves of its (first) network, the test
figures and the artifacts. A model of several networks (ensemble members, a tile model) has each network's
own run nested under it (tag ``mlflow.parentRunId``, what ``mlflow.start_run(nested=True)`` sets), named
``member-<k>`` and ``tile-model``; the model's run is named by ``run_name``. The model's run id travels in
``models/train/run.json`` (a DVC output of train), so a later stage that DVC re-runs logs into the run of
the model it works on instead of creating an orphan run.

Logging never kills a stage. Every call goes through a ``Run`` object; when the tracking server
cannot be reached (mid-run, or already when a later stage resumes the run), the call is appended to
``.mlflow-buffer/`` instead: metrics with their step and timestamp, params, tags, and copies of
artifact files. After a failure the stage stops trying for ``RETRY_AFTER_S`` seconds, so a dead server
costs one timeout, not one per epoch. The buffer is sent, in order, the next time any stage opens a
run against that server, or by ``defect mlflow-flush``; the stage prints what it could not log.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from pipeline.config import MlflowConfig

log = logging.getLogger(__name__)

BUFFER_ROOT = Path(".mlflow-buffer")
RETRY_AFTER_S = 30.0
# MLflow's defaults retry a dead server 7 times with exponential backoff: minutes per call.
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


class TrackingUnavailable(RuntimeError):
    """A new run cannot be created because the tracking store cannot be reached."""


def tracking_uri(cfg: MlflowConfig) -> str:
    """``MLFLOW_TRACKING_URI`` in the environment wins over ``mlflow.tracking_uri``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri


def client_for(cfg: MlflowConfig) -> MlflowClient:
    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    uri = tracking_uri(cfg)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(client: MlflowClient, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if client.tracking_uri.startswith("sqlite:"):  # keep artifacts beside the local store, not in the cwd
        artifact_location = Path("mlartifacts").resolve().as_uri()
    return client.create_experiment(
        name,
        artifact_location=artifact_location,
        # Marks the experiment as model training (MLflow 3 UI); 3.17 still opens its GenAI overview first in a
        # new browser: the sidebar switch "Model training" shows the runs table (see README).
        tags={"mlflow.experimentKind": "custom_model_development"},
    )


def _git(*args: str) -> str:
    """git's stdout as it printed it ("" outside a repository, or where git is missing or stuck)."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def dvc_outputs(dvc_yaml: Path = Path("dvc.yaml")) -> set[str]:
    """Every path that ``dvc.yaml`` declares as a stage's outs, metrics or plots (normalized, relative)."""
    if not dvc_yaml.is_file():
        return set()
    stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}
    paths = set()
    for body in stages.values():
        for key in ("outs", "metrics", "plots"):
            for entry in body.get(key) or []:
                paths.add(os.path.normpath(entry if isinstance(entry, str) else next(iter(entry))))
    return paths


def changed_files() -> list[str]:
    """Tracked files that differ from the commit (staged or not), relative to the current folder when
    inside it; untracked files are left out (data, caches and scratch files are not the code)."""
    prefix = _git("rev-parse", "--show-prefix").strip()
    entries = iter(_git("status", "--porcelain=v1", "-z", "--untracked-files=no").split("\0"))
    files = []
    for entry in entries:
        if len(entry) < 4:
            continue
        if "R" in entry[:2] or "C" in entry[:2]:
            next(entries, None)  # a rename or copy: the old path follows; the new one is what the tree holds
        path = entry[3:]
        files.append(path[len(prefix) :] if prefix and path.startswith(prefix) else path)
    return sorted(files)


def git_info(dvc_yaml: Path = Path("dvc.yaml")) -> dict[str, str]:
    """The commit, and whether the code differs from it. DVC rewrites its own files on every ``dvc repro``
    (dvc.lock, the metrics and reports that dvc.yaml declares with ``cache: false``, the .gitignore files it
    keeps) and the stages write ``reports/`` (the whole folder: what a stage writes there beside its declared
    outputs too), so those never make a run dirty. ``git.dirty``: a tracked file other than those and params.yaml
    changed; ``git.params_dirty``: params.yaml differs from the commit (as it does under ``dvc exp run -S``);
    ``git.dirty_files``: which files, params.yaml included."""
    commit = _git("rev-parse", "HEAD").strip()
    outputs = dvc_outputs(dvc_yaml)

    def made_by_dvc(path: str) -> bool:
        norm = os.path.normpath(path)
        if norm == "dvc.lock" or Path(norm).name == ".gitignore" or norm.startswith("reports" + os.sep):
            return True
        return any(norm == out or norm.startswith(out + os.sep) for out in outputs)

    changed = [f for f in changed_files() if not made_by_dvc(f)] if commit else []
    code = [f for f in changed if f != "params.yaml"]
    tags = {
        "git.commit": commit or "unknown",
        "git.dirty": str(bool(code)).lower(),
        "git.params_dirty": str("params.yaml" in changed).lower(),
    }
    if changed:
        shown = ", ".join(changed[:20]) + (f" and {len(changed) - 20} more" if len(changed) > 20 else "")
        tags["git.dirty_files"] = shown
    return tags


def run_name(label: str, image_px: int, data_fingerprint: str) -> str:
    """``<when>-<label>-<px>px-<data>``: ``when`` is the DVC experiment's name under ``dvc exp run`` (dvc sets
    DVC_EXP_NAME for the stages it runs, a random name when ``-n`` is not given), else the local time as
    MMDD-HHMM. The part that tells runs apart comes first: the MLflow UI cuts long names at the end."""
    when = os.environ.get("DVC_EXP_NAME") or time.strftime("%m%d-%H%M")
    return f"{when}-{label}-{image_px}px-{data_fingerprint[:6]}"


def lineage_tags(path: Path = Path("dvc.lock"), params_file: Path = Path("params.yaml")) -> dict[str, str]:
    """What this run was made from: the md5 of each data folder in dvc.lock (``data/raw`` ... ``data/augmented``,
    the data lineage; later stages' entries would be those of the previous run), the md5 of params.yaml and
    of dvc.lock itself, and the DVC experiment name when under ``dvc exp run``."""
    tags: dict[str, str] = {}
    if path.is_file():
        tags["dvc.lock.md5"] = hashlib.md5(path.read_bytes()).hexdigest()
        lock = yaml.safe_load(path.read_text()) or {}
        for stage, body in (lock.get("stages") or {}).items():
            for out in body.get("outs") or []:
                if "md5" in out and out["path"].startswith("data/"):
                    tags[f"dvc.{stage}.{out['path']}"] = out["md5"]
    if params_file.is_file():
        tags["params.md5"] = hashlib.md5(params_file.read_bytes()).hexdigest()
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp.name"] = os.environ["DVC_EXP_NAME"]
        tags["dvc.exp.baseline"] = os.environ.get("DVC_EXP_BASELINE_REV", "")
    return tags


def _unreachable(exc: Exception) -> bool:
    """A store that cannot be reached, as opposed to a request the store refused."""
    if isinstance(exc, MlflowException):
        return exc.error_code in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE") or "API request" in exc.message
    return isinstance(exc, OSError | ConnectionError)


class Buffer:
    """Calls that could not reach one tracking store, as JSON lines plus copied artifact files."""

    def __init__(self, uri: str, root: Path = BUFFER_ROOT) -> None:
        self.uri = uri
        self.dir = root / hashlib.sha1(uri.encode()).hexdigest()[:12]
        self.queue = self.dir / "queue.jsonl"

    def pending(self) -> int:
        return sum(1 for _ in self.queue.open()) if self.queue.is_file() else 0

    def add(self, run_id: str, op: str, **data: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "uri.txt").write_text(self.uri + "\n")
        if op == "artifacts":  # copy now: the stage's files may change before the server is back
            dest = self.dir / "files" / f"{time.time_ns()}"
            src = Path(data["local"])
            if src.is_dir():
                shutil.copytree(src, dest)
            else:
                dest.mkdir(parents=True)
                shutil.copy2(src, dest / src.name)
            data["local"] = str(dest)
        with self.queue.open("a") as f:
            f.write(json.dumps({"run_id": run_id, "op": op, **data}) + "\n")

    def flush(self, client: MlflowClient) -> int:
        """Send every buffered call in order; stop at the first failure and keep the rest. Returns sent."""
        if not self.queue.is_file():
            return 0
        entries = [json.loads(line) for line in self.queue.read_text().splitlines() if line.strip()]
        sent = 0
        try:
            for e in entries:
                _send(client, e)
                sent += 1
        finally:
            rest = entries[sent:]
            if rest:
                self.queue.write_text("".join(json.dumps(e) + "\n" for e in rest))
            else:
                shutil.rmtree(self.dir, ignore_errors=True)
        return sent


def _send(client: MlflowClient, e: dict) -> None:
    run_id, op = e["run_id"], e["op"]
    if op == "metrics":
        ts, step = e["timestamp"], e["step"]
        client.log_batch(run_id, metrics=[Metric(k, float(v), ts, step) for k, v in e["values"].items()])
    elif op == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in e["values"].items()])
    elif op == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in e["values"].items()])
    elif op == "artifacts":
        client.log_artifacts(run_id, e["local"], e["path"])
    elif op == "terminate":
        client.set_terminated(run_id, e["status"])
    else:
        raise ValueError(f"unknown buffered MLflow call {op!r}")


def flush_all(root: Path = BUFFER_ROOT) -> dict[str, tuple[int, int]]:
    """Send every buffer under ``root`` to its own store: {uri: (sent, still pending)}."""
    result = {}
    for d in sorted(root.glob("*/uri.txt")):
        uri = d.read_text().strip()
        buf = Buffer(uri, root)
        try:
            sent = buf.flush(MlflowClient(tracking_uri=uri))
        except Exception as exc:  # noqa: BLE001 - reported, kept for the next try
            log.warning("MLflow at %s still unreachable (%s): %d calls kept", uri, _short(exc), buf.pending())
            sent = 0
        result[uri] = (sent, buf.pending())
    return result


def _short(exc: Exception) -> str:
    text = exc.message if isinstance(exc, MlflowException) else str(exc)
    return text.splitlines()[0][:200] if text else type(exc).__name__


class Run:
    """One MLflow run; every call is sent now, or buffered when the store cannot be reached."""

    def __init__(self, client: MlflowClient, run_id: str, buffer: Buffer) -> None:
        self.client, self.run_id, self.buffer = client, run_id, buffer
        self.new = False  # open_run: True when the run was created rather than continued
        self.offline_until = 0.0
        self.buffered = 0
        self.last_error = ""

    def _call(self, op: str, send, **data: Any) -> None:
        if time.monotonic() >= self.offline_until:
            try:
                if self.buffer.pending():
                    self.buffer.flush(self.client)  # keep the order: older calls first
                send()
                return
            except Exception as exc:  # noqa: BLE001 - any failure to log must not end the stage
                if not _unreachable(exc) and not self.buffer.pending():
                    raise
                self.last_error = _short(exc)
                self.offline_until = time.monotonic() + RETRY_AFTER_S
                log.warning(
                    "MLflow at %s unreachable (%s): buffering in %s and training on",
                    self.client.tracking_uri,
                    self.last_error,
                    self.buffer.dir,
                )
        self.buffer.add(self.run_id, op, **data)
        self.buffered += 1

    def log_metrics(self, values: dict[str, float], step: int | None = None) -> None:
        ts, step = int(time.time() * 1000), step or 0
        values = {k: float(v) for k, v in values.items()}
        metrics = [Metric(k, v, ts, step) for k, v in values.items()]
        self._call(
            "metrics",
            lambda: self.client.log_batch(self.run_id, metrics=metrics),
            values=values,
            step=step,
            timestamp=ts,
        )

    def log_params(self, values: dict[str, Any]) -> None:
        values = {k: str(v)[:500] for k, v in values.items()}
        self._call(
            "params",
            lambda: self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in values.items()]),
            values=values,
        )

    def set_tags(self, values: dict[str, Any]) -> None:
        values = {k: str(v) for k, v in values.items()}
        self._call(
            "tags",
            lambda: self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in values.items()]),
            values=values,
        )

    def log_artifacts(self, local: str | Path, path: str) -> None:
        """A folder's files, or a single file, under the artifact folder ``path``."""
        local = str(local)
        upload = self.client.log_artifacts if Path(local).is_dir() else self.client.log_artifact
        self._call("artifacts", lambda: upload(self.run_id, local, path), local=local, path=path)

    def finish(self, status: str = "FINISHED") -> None:
        self._call("terminate", lambda: self.client.set_terminated(self.run_id, status), status=status)
        if self.buffered:
            print(
                f"MLflow: {self.buffered} logging call(s) could not reach {self.client.tracking_uri} "
                f"({self.last_error}); kept in {self.buffer.dir} and sent by the next stage or `defect mlflow-flush`",
                flush=True,
            )


@contextlib.contextmanager
def open_run(
    cfg: MlflowConfig, run_id: str | None = None, run_name: str | None = None, tags: dict[str, Any] | None = None
) -> Iterator[Run]:
    """Continue run ``run_id`` (when it still exists) or start a new one in ``cfg.experiment``.

    ``run.new`` tells the caller which happened. A run that vanished from the store (reset, other URI)
    is replaced by a new one instead of losing the work; a store that cannot be reached while continuing
    a known run only buffers; a new run needs the store (``TrackingUnavailable`` otherwise)."""
    client = client_for(cfg)
    buffer = Buffer(client.tracking_uri)
    if buffer.pending():
        with contextlib.suppress(Exception):
            n = buffer.flush(client)
            log.info("MLflow: sent %d buffered calls to %s", n, client.tracking_uri)
    run = None
    if run_id:
        try:
            client.get_run(run_id)
            run = Run(client, run_id, buffer)
            client.update_run(run_id, status="RUNNING")
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                log.warning("MLflow run %s is not in %s any more: continuing in a new run", run_id, client.tracking_uri)
            elif _unreachable(exc):
                run = Run(client, run_id, buffer)  # the id is known: log into the buffer
                run.offline_until = time.monotonic() + RETRY_AFTER_S
                run.last_error = _short(exc)
            else:
                raise
    if run is None:
        try:
            created = client.create_run(experiment_id(client, cfg.experiment), run_name=run_name, tags=tags or {})
        except Exception as exc:  # noqa: BLE001
            raise TrackingUnavailable(
                f"mlflow.tracking_uri {client.tracking_uri}: cannot create a run ({_short(exc)}); start the "
                "tracking server (scripts/tracking_server.sh start) or point MLFLOW_TRACKING_URI at a reachable store"
            ) from None
        run = Run(client, created.info.run_id, buffer)
        run.new = True
    elif tags:
        run.set_tags(tags)
    try:
        yield run
    except BaseException:
        run.finish("FAILED")
        raise
    run.finish()


def read_run_id(path: Path) -> str:
    return json.loads(path.read_text())["run_id"]


def resume_run(cfg: MlflowConfig, run_file: Path, stage: str | None = None) -> contextlib.AbstractContextManager[Run]:
    """Continue the run of the model that ``run_file`` (written by train) belongs to."""
    tags = {f"stage.{stage}.params_md5": lineage_tags().get("params.md5", "")} if stage else None
    return open_run(cfg, run_id=read_run_id(run_file), tags=tags)
