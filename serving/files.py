"""Every file on its own: what ``predict`` and ``watch`` share so that no single file stops a run.

- ``list_inputs`` turns the command line's files, folders and globs into every entry found, each with the
  reason it is skipped ('' for a regular file to score): a FIFO, socket or device is never opened (reading
  a FIFO with no writer blocks forever), a link to a folder is not followed (a link loop cannot hang the
  walk), an input that matches nothing is a row of its own rather than an exit before any work.
- ``score_files`` is ``Runner.predict_files`` with a safety net: whatever goes wrong while scoring a batch
  (an exception the decoder or the model raised and nothing below caught), the files of that batch are
  scored again one at a time, and the one that fails alone gets an error row naming the exception. Every
  path passed in gets exactly one row, and the good files beside a poison one are scored.
"""

from __future__ import annotations

import glob
import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from serving.card import file_kind
from serving.runner import Prediction, Runner

log = logging.getLogger(__name__)


def skipped(path: str | Path, reason: str, latency_ms: float = 0.0) -> Prediction:
    """The row of a file that was not scored: no class, no scores, the reason in ``error``."""
    return Prediction(str(path), latency_ms=latency_ms, error=reason)


def why_not_regular(path: Path) -> str:
    """'' for a regular file (a link to one is followed), else why it is skipped."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "skipped: a broken symbolic link" if os.path.islink(path) else "skipped: the file vanished"
    except OSError as exc:
        return f"skipped: cannot stat it ({exc.strerror})"
    return "" if stat.S_ISREG(mode) else f"skipped: {file_kind(mode)}, not a regular file"


def _walk(root: Path) -> list[tuple[Path, str]]:
    """Every entry under ``root`` without following links to folders, each with its skip reason."""
    out: list[tuple[Path, str]] = []

    def unlistable(exc: OSError) -> None:
        out.append((Path(exc.filename), f"skipped: cannot list this folder ({exc.strerror})"))

    for folder, dirs, files in os.walk(root, onerror=unlistable, followlinks=False):
        for d in dirs:
            if os.path.islink(os.path.join(folder, d)):
                out.append((Path(folder, d), "skipped: a symbolic link to a folder (not followed)"))
        out += [(Path(folder, f), why_not_regular(Path(folder, f))) for f in files]
    return out


def list_inputs(inputs: Iterable[str]) -> list[tuple[Path, str]]:
    """Files, folders (recursively) and globs -> every entry found, sorted within each input, each with ''
    (a regular file to score) or why it is skipped. A folder a glob matches is left to the glob's own
    file matches; hidden files are scored like any other (a person named the folder)."""
    out: list[tuple[Path, str]] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            out += sorted(_walk(p))
        elif os.path.lexists(p):
            out.append((p, why_not_regular(p)))
        else:
            matches = sorted(Path(m) for m in glob.glob(item, recursive=True) if not os.path.isdir(m))
            out += [(m, why_not_regular(m)) for m in matches] or [(p, "no such file, folder or matching glob")]
    return out


def _alone(runner: Runner, path: str) -> Prediction:
    """One file scored by itself; any exception is its error row."""
    t0 = time.perf_counter()
    try:
        rows = list(runner.predict_files([path], 1))
    except Exception as exc:  # noqa: BLE001 (the safety net: whatever one file raises is that file's row)
        log.warning("%s: %s: %s", path, type(exc).__name__, exc)
        return skipped(path, f"{path}: {type(exc).__name__}: {exc}", (time.perf_counter() - t0) * 1000)
    row = next((r for r in rows if r.path == path), None)
    return row or skipped(path, f"{path}: the runner returned no result for this file")


def score_files(runner: Runner, paths: Iterable[str | Path], batch_size: int = 16) -> Iterator[Prediction]:
    """One row per path, in batches of ``batch_size`` (``Runner.predict_files``), never an exception: a batch
    that raises is scored again one file at a time (see the module docstring)."""
    paths = [str(p) for p in paths]
    for start in range(0, len(paths), batch_size):
        chunk = paths[start : start + batch_size]
        owed = Counter(chunk)  # rows still owed per path (a path given twice gets two)
        try:
            for row in runner.predict_files(chunk, batch_size):
                if owed[row.path] > 0:
                    owed[row.path] -= 1
                    yield row
        except Exception as exc:  # noqa: BLE001 (see above; the files are retried alone below)
            log.warning(
                "a batch of %d files failed (%s: %s): scoring them one by one", len(chunk), type(exc).__name__, exc
            )
        for path in chunk:
            if owed[path] > 0:
                owed[path] -= 1
                yield _alone(runner, path)
