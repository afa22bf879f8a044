"""Side-by-side timing: the edge runner (onnxruntime) vs PyTorch eager on the same model and images.

Machines here are shared and noisy, so every comparison is interleaved (runner, torch, runner, torch,
...) in one process and reported as medians with the spread, plus the ratio of the medians.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from serving.runner import Runner


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summarize(seconds: list[float], images_per_call: int) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": p99,
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "img_s": images_per_call / (statistics.median(ms) / 1000),
        "calls": len(ms),
    }


def interleaved(
    contenders: dict[str, Callable[[], object]], images_per_call: int, repeats: int, warmup: int, rounds: int = 5
) -> dict[str, dict]:
    """Run each contender ``warmup`` times, then ``rounds`` alternating rounds of ``repeats // rounds`` calls."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name] += time_calls(fn, per_round)
    return {name: summarize(s, images_per_call) for name, s in samples.items()}


def batches(images: np.ndarray, batch_size: int) -> np.ndarray:
    """A (batch_size, H, W, C) batch drawn from images, repeating them when there are too few."""
    idx = np.arange(batch_size) % len(images)
    return np.ascontiguousarray(images[idx])


def photographs(runner: Runner, files: list[Path]) -> np.ndarray:
    """The files as a runner with tiles takes them (full resolution), stacked: the largest group of one size,
    since a batch holds photographs of one size."""
    groups: dict[tuple[int, ...], list[np.ndarray]] = {}
    for f in files:
        img = runner.load(f)
        groups.setdefault(img.shape, []).append(img)
    return np.stack(max(groups.values(), key=len))


def variant_files(export_dir: Path) -> dict[str, Path]:
    """The exported variants present: {"fp32": model.onnx, "fp16": model.fp16.onnx, "int8": ...}."""
    files = {"fp32": export_dir / "model.onnx"}
    for v in ("fp16", "int8"):
        if (export_dir / f"model.{v}.onnx").exists():
            files[v] = export_dir / f"model.{v}.onnx"
    return files


def as_jpeg(files: list[Path], folder: Path) -> list[Path]:
    """The same images re-encoded as JPEG (quality 95) in ``folder``, as most line cameras send them."""
    out = []
    for i, f in enumerate(files):
        out.append(folder / f"{i:05d}.jpg")
        Image.open(f).convert("RGB").save(out[-1], quality=95)
    return out


def timed_for(fn: Callable[[], int], seconds: float) -> float:
    """Call ``fn`` (which returns how many images it handled) until ``seconds`` pass; images/s."""
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        n += fn()
    return n / elapsed


class HttpLoad:
    """Closed-loop HTTP clients: ``concurrency`` threads, each with one keep-alive connection, each
    sending its next request as soon as the previous answer arrives (as a camera line would)."""

    def __init__(self, host: str, port: int, path: str, bodies: list[tuple[bytes, dict[str, str]]]) -> None:
        self.host, self.port, self.path, self.bodies = host, port, path, bodies

    def run(self, concurrency: int, seconds: float) -> dict:
        latencies: list[float] = []
        errors = [0]
        lock = threading.Lock()
        deadline = time.perf_counter() + seconds

        def client(k: int) -> None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            mine, i = [], k
            while time.perf_counter() < deadline:
                body, headers = self.bodies[i % len(self.bodies)]
                t0 = time.perf_counter()
                conn.request("POST", self.path, body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    with lock:
                        errors[0] += 1
                mine.append(time.perf_counter() - t0)
                i += 1
            conn.close()
            with lock:
                latencies.extend(mine)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        out = summarize(latencies, 1) if latencies else {}
        out |= {"img_s": len(latencies) / wall, "requests": len(latencies), "errors": errors[0]}
        return out


def binary_infer_body(input_name: str, image: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 infer request for one (H, W, C) uint8 image, binary tensor extension (as tritonclient)."""
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": input_name,
                    "shape": [1, *image.shape],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": image.size},
                }
            ],
            "outputs": [{"name": "defect_score", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}
    return head + image.tobytes(), headers


def end_to_end(runners: dict[str, Runner], files: dict[str, list[Path]], rounds: int, batch: int) -> dict:
    """Images/s from encoded files (decode, resize, infer) per variant and file format, interleaved."""
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for v, runner in runners.items():
            for fmt, paths in files.items():
                t0 = time.perf_counter()
                n = sum(1 for r in runner.predict_files(paths, batch) if not r.error)
                samples.setdefault((v, fmt), []).append(n / (time.perf_counter() - t0))
    out: dict = {}
    for (v, fmt), s in samples.items():
        out.setdefault(v, {})[f"{fmt}_img_s"] = float(np.median(s))
    return out


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


@contextlib.contextmanager
def runner_server(model: Path, max_batch: int, server_args: tuple[str, ...] = ()) -> Iterator[str]:
    """`defect-runner serve` for ``model`` on a free loopback port, ready; yields its URL, SIGTERM at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "serving.cli",
        "serve",
        "--model",
        str(model),
        "--providers",
        "cpu",
        "--port",
        str(port),
        "--max-batch-size",
        str(max_batch),
        "--force",
        *server_args,
    ]
    env = {**os.environ, "DEFECT_RUNNER_TOKEN": ""}
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if urllib.request.urlopen(url + "/v2/health/ready", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def http_vs_in_process(
    model: Path,
    x: np.ndarray,
    pngs: list[Path],
    concurrency: int,
    seconds: float,
    rounds: int,
    max_batch: int = 16,
    server_args: tuple[str, ...] = (),
) -> dict:
    """`defect-runner serve` under closed-loop load vs the same model called in this process."""
    with runner_server(model, max_batch, server_args) as url:
        port = int(url.rsplit(":", 1)[1])
        runner = Runner(model, providers="cpu", force=True)
        name = runner.card.name
        tensors = HttpLoad(
            "127.0.0.1", port, f"/v2/models/{name}/infer", [binary_infer_body(runner.input_name, img) for img in x]
        )
        images = HttpLoad(
            "127.0.0.1",
            port,
            f"/v2/models/{name}/classify",
            [(p.read_bytes(), {"Content-Type": "image/png"}) for p in pngs],
        )
        batch = batches(x, max_batch)
        samples: dict[str, list] = {"in_process": [], "http_infer": [], "in_process_files": [], "http_classify": []}
        mean_batch = []
        for _ in range(rounds):
            samples["in_process"].append(timed_for(lambda: len(runner.predict(batch)[1]), seconds))
            before = metric_sum(url, "defect_runner_batch_size_sum"), metric_sum(url, "defect_runner_batch_size_count")
            samples["http_infer"].append(tensors.run(concurrency, seconds))
            after = metric_sum(url, "defect_runner_batch_size_sum"), metric_sum(url, "defect_runner_batch_size_count")
            mean_batch.append((after[0] - before[0]) / max(1.0, after[1] - before[1]))
            samples["in_process_files"].append(
                timed_for(lambda: sum(1 for _ in runner.predict_files(pngs, max_batch)), seconds)
            )
            samples["http_classify"].append(images.run(concurrency, seconds))

    def med(key: str, field: str = "img_s") -> float:
        return float(np.median([s[field] if isinstance(s, dict) else s for s in samples[key]]))

    return {
        "variant": runner.card.variant,
        "concurrency": concurrency,
        "max_batch_size": max_batch,
        "in_process_img_s": med("in_process"),
        "infer_img_s": med("http_infer"),
        "infer_p50_ms": med("http_infer", "p50_ms"),
        "infer_p99_ms": med("http_infer", "p99_ms"),
        "infer_errors": sum(s["errors"] for s in samples["http_infer"]),
        "mean_batch": float(np.median(mean_batch)),
        "infer_vs_in_process": med("http_infer") / med("in_process"),
        "in_process_files_img_s": med("in_process_files"),
        "classify_img_s": med("http_classify"),
        "classify_p50_ms": med("http_classify", "p50_ms"),
        "classify_p99_ms": med("http_classify", "p99_ms"),
        "classify_errors": sum(s["errors"] for s in samples["http_classify"]),
        "classify_vs_in_process": med("http_classify") / med("in_process_files"),
    }
