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
from pathlib import Path

from serving.review import ReviewQueue, ReviewRule, unique_target
from serving.runner import Runner

log = logging.getLogger(__name__)

try:  # optional: without watchdog the loop polls the inbox
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer
except ImportError:  # pragma: no cover
    FileSystemEventHandler, Observer = object, None


class _Wake(FileSystemEventHandler):
    """Sets ``event`` on any file event in the watched folder, so the loop rescans at once."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__()
        self.event = event

    def on_any_event(self, event) -> None:
        self.event.set()


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
        self.queue = ReviewQueue(review)
        for d in (inbox, done, failed):
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
                reasons = self.rule.reasons(p.defect_score, p.probs, self.runner.card.threshold)
                row = dataclasses.asdict(p) | {"file": rel.as_posix()}
                if p.error:
                    target = unique_target(self.failed, rel.name)
                    self.counts["failed"] += 1
                else:
                    target = unique_target(self.done, rel.name)
                    self.counts["done"] += 1
                    if reasons:
                        self.queue.add(path, rel.name, p.label, row, reasons)
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
        if not once and Observer is None:
            log.warning("watchdog is not installed: polling the inbox every %.1f s", poll)
        elif not once:
            observer = Observer()
            observer.schedule(_Wake(self.wake), str(self.inbox), recursive=True)
            observer.start()
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
