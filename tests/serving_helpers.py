"""Start a real ``defect-runner serve`` process for tests, and make model versions that differ."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import onnx
import requests
from onnx import TensorProto, helper

from serving.card import ModelCard, card_path_for, sha256_file
from tests.conftest import ROOT, venv_env

TOKEN = "line7-secret"


def runner_graph(nodes: list, init: list, name: str, side: int, classes: int = 3) -> onnx.ModelProto:
    """A checked ONNX model with the runner's contract: ``image`` (batch, side, side, 3) uint8 in, ``probs``
    (batch, classes) and ``defect_score`` (batch) out; ``nodes`` and ``init`` compute them."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["batch", side, side, 3])],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes]),
            helper.make_tensor_value_info("defect_score", TensorProto.FLOAT, ["batch"]),
        ],
        init,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | Path, *args: str, token: str | None = TOKEN, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        env = {**venv_env(), **(env or {})}
        env.pop("DEFECT_RUNNER_TOKEN", None)
        if token:
            env["DEFECT_RUNNER_TOKEN"] = token
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", str(model), "--providers", "cpu"]
        cmd += ["--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if requests.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.output()[-3000:]}")

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers=kw.pop("headers", self.headers), timeout=30, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, headers=kw.pop("headers", self.headers), timeout=30, **kw)

    def metric(self, metric_name: str, **labels: str) -> float:
        """A sample's value from /metrics (0 when absent)."""
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            metric, _, rest = key.partition("{")
            got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if metric == metric_name and got == want:
                return float(value)
        return 0.0

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def new_version(model: Path, dest: Path, note: str) -> Path:
    """A copy of ``model`` that differs only in its ONNX doc string: same scores, another sha256/version."""
    dest.mkdir(parents=True, exist_ok=True)
    proto = onnx.load(str(model))
    proto.doc_string = note
    out = dest / model.name
    onnx.save(proto, str(out))
    card = ModelCard.read(card_path_for(model))
    ModelCard.from_dict({**card.__dict__, "input": card.input.__dict__, "sha256": sha256_file(out)}).write(
        card_path_for(out)
    )
    return out


def copy_model(model: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(model, dest / model.name)
    shutil.copy2(card_path_for(model), card_path_for(dest / model.name))
    return dest / model.name
