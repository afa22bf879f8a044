"""The review queue: images the model is unsure about, copied out for a person to label.

An image goes to the queue when its defect score is within ``margin`` of the card's threshold or its top
class probability is below ``min_confidence``. A defect-type sorting card has no threshold: there the
confidence rule alone decides (an image whose most likely class is below ``min_confidence`` is queued,
in the folder of that class), and the margin does not apply. It is copied (never moved) to ``<queue>/<predicted
class>/`` and listed in ``<queue>/queue.jsonl``: its result row as the runner wrote it (defect score, the
card's threshold, decision, class, ``reason``, model and version), ``review`` (its path in the queue) and
``review_reasons`` (why it was queued). A person moves wrong ones into the right class folder and adds the
folder as a new batch (``defect ingest <queue>``), so the next retraining learns from exactly the images
the model found hard. The folder watcher and the HTTP server both feed it.
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ReviewRule:
    """When an image goes to the review queue (both may apply; 0 switches a rule off)."""

    margin: float = 0.1  # |defect score - threshold| at most this (binary cards: a sorting card has no threshold)
    min_confidence: float = 0.6  # the top class probability below this

    def reasons(self, score: float | None, probs: dict[str, float] | None, threshold: float | None) -> list[str]:
        """Why an image is queued ([] when it is not); ``threshold`` None: a sorting card, no margin rule."""
        out: list[str] = []
        if score is None or probs is None:
            return out
        if self.margin and threshold is not None and abs(score - threshold) <= self.margin:
            out.append(f"score {score:.3f} within {self.margin} of the threshold {threshold:.3f}")
        if self.min_confidence and max(probs.values()) < self.min_confidence:
            out.append(f"top class probability {max(probs.values()):.3f} < {self.min_confidence}")
        return out


def unique_target(folder: Path, name: str) -> Path:
    """``folder/name``, or ``folder/stem.1.ext`` ... when a file of that name is already there."""
    target = folder / name
    n = 1
    while target.exists():
        target = folder / f"{Path(name).stem}.{n}{Path(name).suffix}"
        n += 1
    return target


class ReviewQueue:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()  # the server adds from several threads

    def add(self, image: Path | bytes, name: str, label: str | None, row: dict[str, Any], reasons: list[str]) -> Path:
        """Copy ``image`` (a file or its bytes) into the queue; return its path inside the queue."""
        with self.lock:
            target = unique_target(self.root / (label or "unknown"), Path(name).name)
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(image, bytes):
                target.write_bytes(image)
            else:
                shutil.copy2(image, target)
            rel = target.relative_to(self.root).as_posix()
            with open(self.root / "queue.jsonl", "a") as q:
                q.write(json.dumps(row | {"review": rel, "review_reasons": reasons}) + "\n")
            return target

    def count(self) -> int:
        """Images listed in the queue file (what is waiting for a person, unless already handled)."""
        path = self.root / "queue.jsonl"
        if not path.is_file():
            return 0
        with open(path) as f:
            return sum(1 for _ in f)
