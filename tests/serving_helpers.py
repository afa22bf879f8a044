"""Start a real ``defect-runner serve`` process for tests, make model versions that differ, and build tiny
hand-made models with the runner's contract (binary, or defect-type sorting) without pipeline/ code."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import onnx
import requests
from onnx import TensorProto, helper
from PIL import Image

from serving.card import (
    METADATA_CARD,
    METADATA_CARD_SHA256,
    SORTING_OUTPUTS,
    InputSpec,
    ModelCard,
    card_path_for,
    card_sha256,
    sha256_file,
)
from serving.review import ReviewRule
from serving.runner import Runner
from serving.watch import Watcher
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


def share_graph(side: int, sorting: bool = False) -> onnx.ModelProto:
    """(N, side, side, 3) uint8 -> ``probs`` (N, 3), the channel means over their sum (so a flat colour picks
    them: (150, 60, 40) is p = (0.6, 0.24, 0.16)), and ``defect_score`` (N,): 1 - probs[:, 0] (class 0 is the
    OK class) or, with ``sorting``, the most likely class's probability, as a defect-type sorting export."""
    init = [
        helper.make_tensor("tiny", TensorProto.FLOAT, [], [1e-6]),
        helper.make_tensor("channels", TensorProto.INT64, [1], [1]),
    ]
    nodes = [
        helper.make_node("Cast", ["image"], ["x"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["x"], ["means"], axes=[1, 2], keepdims=0),
        helper.make_node("ReduceSum", ["means", "channels"], ["total"], keepdims=1),
        helper.make_node("Add", ["total", "tiny"], ["safe"]),
        helper.make_node("Div", ["means", "safe"], ["probs"]),
    ]
    if sorting:
        nodes.append(helper.make_node("ReduceMax", ["probs"], ["defect_score"], axes=[1], keepdims=0))
    else:
        init += [
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
            helper.make_tensor("ok", TensorProto.INT64, [], [0]),
        ]
        nodes += [
            helper.make_node("Gather", ["probs", "ok"], ["p_ok"], axis=1),
            helper.make_node("Sub", ["one", "p_ok"], ["defect_score"]),
        ]
    return runner_graph(nodes, init, "share_sorting" if sorting else "share", side)


def share_card(side: int, threshold: float, **fields) -> ModelCard:
    """A binary card for ``share_graph(side)``: classes ok (the OK class, column 0), scratch and dent."""
    return ModelCard(
        name="shares",
        architecture="share",
        classes=["ok", "scratch", "dent"],
        ok_class="ok",
        input=InputSpec(side, 3, "letterbox"),
        threshold=threshold,
        **fields,
    )


def sorting_card(side: int, classes: list[str], **fields) -> ModelCard:
    """A defect-type sorting card for ``share_graph(side, sorting=True)``: no OK class, no threshold."""
    return ModelCard(
        name="steel-sorter",
        architecture="share",
        classes=classes,
        ok_class=None,
        input=InputSpec(side, 3, "letterbox"),
        threshold=None,
        outputs=dict(SORTING_OUTPUTS),
        **fields,
    )


def flat_images(folder: Path, colours: dict[str, tuple[int, int, int]], side: int) -> dict[str, Path]:
    """``folder/<name>.png`` for each name: ``side`` px of one flat colour, which picks ``share_graph``'s
    probabilities."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, rgb in colours.items():
        out[name] = folder / f"{name}.png"
        Image.new("RGB", (side, side), rgb).save(out[name])
    return out


def watch_once(runner: Runner, images: Iterable[Path], folder: Path, rule: ReviewRule) -> tuple[dict, list, list]:
    """``images`` copied into an inbox under ``folder`` and watched once: the watcher's counts, its result
    rows and its review queue's rows."""
    inbox, out = folder / "inbox", folder / "out"
    inbox.mkdir(parents=True)
    for p in images:
        shutil.copy(p, inbox / p.name)
    watcher = Watcher(runner, inbox, out / "results.jsonl", out / "done", out / "failed", out / "review", rule, 0.0)
    counts = watcher.run(once=True)

    def rows(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    return counts, rows(out / "results.jsonl"), rows(out / "review/queue.jsonl")


def save_carded(model: onnx.ModelProto, card: ModelCard, path: Path) -> Path:
    """``model`` saved at ``path`` with ``card`` bound to it as export binds them (``serving.card``): the card
    in the ONNX metadata with the sha256 of its canonical JSON, and the sidecar with the file's sha256."""
    embedded = card.as_dict()
    embedded.pop("sha256")
    helper.set_model_props(
        model, {METADATA_CARD: json.dumps(embedded, sort_keys=True), METADATA_CARD_SHA256: card_sha256(card)}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    dataclasses.replace(card, sha256=sha256_file(path)).write(card_path_for(path))
    return path


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
