"""Headless Chromium (Debian's /usr/bin/chromium driven by Playwright) and an MLflow UI server for browser tests."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
SHOTS = ROOT / "test-artifacts" / "mlflow-ui"

# Without the background-networking flags Chromium keeps calling home, which floods a closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser_missing() -> str | None:
    """Why a browser test cannot run here, or None when it can."""
    fix = "`apt-get install -y chromium` and `pip install -r requirements.txt` (as .ci/run does)"
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} not found: the MLflow UI check needs Debian's Chromium; {fix}"
    if importlib.util.find_spec("playwright") is None:
        return f"the Python package playwright is not importable; {fix}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(project: Path, log_path: Path, startup_s: float = 240) -> Iterator[str]:
    """`mlflow server` on a free loopback port over ``project``'s SQLite store; yields its base URL.

    The experiment's artifact location is a file URI under the project, which the server reads
    directly; ``--default-artifact-root`` points at the same folder for anything created meanwhile.
    """
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{project / 'mlflow.db'}",
        "--default-artifact-root",
        (project / "mlartifacts").as_uri(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")  # no calls home from a test server
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server not healthy after {startup_s:.0f} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1)
        yield base
    finally:
        # The server runs uvicorn (and job runners) as children: stop the whole group it leads.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium (Playwright sync API); yields the Browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def snapshot(page, name: str) -> Path:
    """Screenshot of ``page`` into test-artifacts/mlflow-ui/<name>.png (path printed, for the test log)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


def dump_failure(page, name: str) -> None:
    """On a failed check: screenshot and the page's visible text, next to the other screenshots."""
    with contextlib.suppress(Exception):
        print(f"screenshot: {snapshot(page, f'{name}-FAILED')}")
    with contextlib.suppress(Exception):
        text = SHOTS / f"{name}-FAILED.txt"
        text.write_text(f"url: {page.url}\n\n{page.inner_text('body')}")
        print(f"page text: {text}")
