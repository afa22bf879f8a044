"""defect-runner watch: files written slowly, broken files and a burst all end up scored and moved."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serving.runner import Runner
from serving.watch import ReviewRule, Watcher
from tests.conftest import ROOT, venv_env


@pytest.fixture
def runner(exported_project) -> Runner:
    return Runner(exported_project / "models/export/model.onnx", providers="cpu")


@pytest.fixture
def images(exported_project) -> list[Path]:
    return sorted((exported_project / "data/raw/images").rglob("*.png"))


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_slow_writes_broken_files_and_a_burst_are_all_accounted_for(runner, images, tmp_path):
    inbox, out = tmp_path / "inbox", tmp_path / "out"
    watcher = Watcher(runner, inbox, out / "results.jsonl", out / "done", out / "failed", out / "review", settle=0.6)
    thread = threading.Thread(target=watcher.run, kwargs={"poll": 0.1}, daemon=True)
    thread.start()
    # A file written in pieces over ~1.5 s, pausing less than the settle time: scored only once complete.
    slow = images[0].read_bytes()
    with open(inbox / "slow.png", "wb") as f:
        for k in range(5):
            f.write(slow[k * len(slow) // 5 : (k + 1) * len(slow) // 5])
            f.flush()
            time.sleep(0.3)
    (inbox / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (inbox / "notes.txt").write_text("not an image")
    (inbox / "cam2").mkdir()
    for i, src in enumerate(images[1:21]):  # a burst of 20, one in a subfolder
        shutil.copy(src, inbox / ("cam2" if i == 0 else "") / f"burst{i}.png")
    deadline = time.time() + 120
    while time.time() < deadline and sum(watcher.counts[k] for k in ("done", "failed")) < 23:
        time.sleep(0.1)
    watcher.stop.set()
    watcher.wake.set()
    thread.join(timeout=30)

    rows = {r["file"]: r for r in results(out)}
    assert len(rows) == 23 and not [p for p in inbox.rglob("*") if p.is_file()], "a file was lost or left"
    assert rows["slow.png"]["error"] == "" and rows["slow.png"]["decision"] in ("ok", "defect")
    assert (out / "done/slow.png").read_bytes() == slow  # moved whole, never truncated
    for bad in ("garbage.png", "notes.txt"):
        assert rows[bad]["error"] and (out / "failed" / bad).exists()
    assert len(list((out / "done").glob("*.png"))) == 21
    assert rows["cam2/burst0.png"]["moved_to"].endswith("done/burst0.png")


def watch_once(runner: Runner, images: list[Path], inbox: Path, out: Path, rule: ReviewRule) -> dict:
    inbox.mkdir(exist_ok=True)
    for src in images:
        shutil.copy(src, inbox / src.name)
    return Watcher(
        runner, inbox, out / "results.jsonl", out / "done", out / "failed", out / "review", rule, settle=0.0
    ).run(once=True)


def test_unsure_images_are_queued_for_review_by_the_rule(runner, images, tmp_path):
    out = tmp_path / "all"
    counts = watch_once(runner, images[:6], tmp_path / "inbox", out, ReviewRule(margin=1.0, min_confidence=0.0))
    assert counts == {"done": 6, "failed": 0, "review": 6, "skipped": 0}  # margin 1: every score qualifies
    queue = [json.loads(line) for line in (out / "review/queue.jsonl").read_text().splitlines()]
    assert len(queue) == 6 and all("of the threshold" in q["review_reasons"][0] for q in queue)
    assert all(q["threshold"] == runner.card.threshold and "the card's threshold" in q["reason"] for q in queue)
    for q in queue:  # laid out as class folders, ready for `defect ingest review/`
        assert (out / "review" / q["review"]).parent.name == q["label"]

    none = tmp_path / "none"
    counts = watch_once(runner, images[:6], tmp_path / "inbox", none, ReviewRule(margin=0.0, min_confidence=0.0))
    assert counts["review"] == 0 and not (none / "review/queue.jsonl").exists()


def test_the_watch_command_scores_an_inbox_once(exported_project, images, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for src in images[:3]:
        shutil.copy(src, inbox / src.name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.cli",
            "watch",
            "--model",
            str(exported_project / "models/export/model.onnx"),
            str(inbox),
            "--out",
            str(tmp_path / "line"),
            "--once",
            "--settle",
            "0",
            "--providers",
            "cpu",
        ],
        env={**venv_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 scored, 0 failed" in proc.stderr
    assert len(results(tmp_path / "line")) == 3
