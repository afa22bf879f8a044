"""``defect-runner watch``: score every image that lands in an inbox folder, next to the line.

A file is scored once it is completely written: its size and modification time have not changed for
``settle`` seconds (a camera or a network copy writing it slowly is waited for). Each result is
appended to a JSONL file (flushed line by line), then the image moves to ``done/`` or, when it cannot
be read, to ``failed/`` with the reason in the results. Nothing is ever deleted. An image the model is
unsure about (defect score within ``review_margin`` of the threshold, or top class probability below
``review_min_confidence``) is also copied to ``review/<predicted class>/`` and listed in
``review/queue.jsonl``: a person moves wrong ones to the right class folder and adds the folder with
``defect ingest review/``, so the next retraining learns from exactly the images the model found hard.

watchdog's file events wake the loop at once; a periodic rescan catches anything an event missed
(network filesystems drop events), so the inbox is the single source of truth.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from serving.runner import Prediction, Runner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReviewRule:
    """When an image goes to the review queue (both may apply; 0 switches a rule off)."""

    margin: float = 0.1  # |defect score - threshold| at most this
    min_confidence: float = 0.6  # the top class probability below this

    def reasons(self, p: Prediction, threshold: float) -> list[str]:
        out = []
        if p.defect_score is None or p.probs is None:
            return out
        if self.margin and abs(p.defect_score - threshold) <= self.margin:
            out.append(f"score {p.defect_score:.3f} within {self.margin} of the threshold {threshold:.3f}")
        if self.min_confidence and max(p.probs.values()) < self.min_confidence:
            out.append(f"top class probability {max(p.probs.values()):.3f} < {self.min_confidence}")
        return out


def unique_target(folder: Path, name: str) -> Path:
    """``folder/name``, or ``folder/stem.1.ext`` ... when a file of that name is already there."""
    target = folder / name
    n = 1
    while target.exists():
        target = folder / f"{Path(name).stem}.{n}{Path(name).suffix}"
        n += 1
    return target


class Watcher:
    def __init__(
        self,
        runner: Runner,
        inbox: Path,
        results: Path,
        done: Path,
        failed: Path,
        review: Path,
        rule: ReviewRule = ReviewRule(),
        settle: float = 1.0,
        batch_size: int = 16,
    ) -> None:
        self.runner, self.inbox, self.results = runner, inbox, results
        self.done, self.failed, self.review, self.rule = done, failed, review, rule
        self.settle, self.batch_size = settle, batch_size
        self.seen: dict[Path, tuple[int, int, float]] = {}  # path -> (size, mtime_ns, stable since)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.counts = {"done": 0, "failed": 0, "review": 0}
        for d in (inbox, done, failed, review):
            d.mkdir(parents=True, exist_ok=True)
        results.parent.mkdir(parents=True, exist_ok=True)

    def ready_files(self) -> list[Path]:
        """Files in the inbox whose size and mtime have been stable for ``settle`` seconds."""
        now, ready, present = time.monotonic(), [], set()
        for path in sorted(p for p in self.inbox.rglob("*") if p.is_file() and not p.name.startswith(".")):
            present.add(path)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            key = (st.st_size, st.st_mtime_ns)
            before = self.seen.get(path)
            if before is None or before[:2] != key:
                self.seen[path] = (*key, now)
            elif now - before[2] >= self.settle:
                ready.append(path)
        self.seen = {p: v for p, v in self.seen.items() if p in present}
        return ready

    def process(self, files: list[Path]) -> None:
        with open(self.results, "a") as out:
            for p in self.runner.predict_files(files, self.batch_size):
                path = Path(p.path)
                rel = path.relative_to(self.inbox)
                reasons = self.rule.reasons(p, self.runner.card.threshold)
                row = dataclasses.asdict(p) | {"file": rel.as_posix()}
                if p.error:
                    target = unique_target(self.failed, rel.name)
                    self.counts["failed"] += 1
                else:
                    target = unique_target(self.done, rel.name)
                    self.counts["done"] += 1
                    if reasons:
                        queued = unique_target(self.review / (p.label or "unknown"), rel.name)
                        queued.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(path, queued)
                        with open(self.review / "queue.jsonl", "a") as q:
                            q.write(
                                json.dumps(
                                    row | {"review": queued.relative_to(self.review).as_posix(), "reasons": reasons}
                                )
                                + "\n"
                            )
                        self.counts["review"] += 1
                        row["review_reasons"] = reasons
                row["moved_to"] = str(target)
                out.write(json.dumps(row) + "\n")
                out.flush()  # the result is on disk before the image leaves the inbox
                shutil.move(path, target)
                self.seen.pop(path, None)

    def run(self, once: bool = False, poll: float = 0.5) -> dict[str, int]:
        """Watch until stopped (or, with ``once``, until the inbox is empty); return the counts."""
        observer = None
        if not once:
            try:
                from watchdog.events import FileSystemEventHandler
                from watchdog.observers import Observer

                class Wake(FileSystemEventHandler):
                    def on_any_event(inner, event):  # noqa: N805 (watchdog's handler signature)
                        self.wake.set()

                observer = Observer()
                observer.schedule(Wake(), str(self.inbox), recursive=True)
                observer.start()
            except ImportError:
                log.warning("watchdog is not installed: polling the inbox every %.1f s", poll)
        log.info("watching %s (results: %s)", self.inbox, self.results)
        try:
            while not self.stop.is_set():
                ready = self.ready_files()
                if ready:
                    self.process(ready[: self.batch_size * 8])
                    continue
                if once and not self.seen:  # nothing left in the inbox, not even a file being written
                    break
                self.wake.wait(min(poll, self.settle / 2) if self.seen else poll)
                self.wake.clear()
        finally:
            if observer is not None:
                observer.stop()
                observer.join()
        return self.counts
