"""``defect-runner watch``: score every image that lands in an inbox folder, next to the line.

A file is scored once it is completely written: its size and modification time have not changed for
``settle`` seconds (a camera or a network copy writing it slowly is waited for). Each result is
appended to a JSONL file (flushed line by line): the runner's row (``serving.runner``: defect score, the
card's threshold, decision, class, ``reason``, model and version) with ``file`` and ``moved_to``. Then
the image moves to ``done/`` or, when it cannot be read, to ``failed/`` with the reason in ``error``.
Nothing is ever deleted. An image the model is unsure about (defect score within ``review_margin`` of the
card's threshold, or top class probability below ``review_min_confidence``: for a defect-type sorting card,
which has no threshold, the latter alone) is also copied to
``review/<predicted class>/`` and listed in ``review/queue.jsonl`` (its result row and its
``review_reasons``): a person moves wrong ones to the right class folder and adds the folder with
``defect ingest review/``, so the next retraining learns from exactly the images the model found hard.

watchdog's file events wake the loop at once; a periodic rescan catches anything an event missed
(network filesystems drop events), so the inbox is the single source of truth.

Every entry of the inbox on its own (README, "Trust and files"):

- **Claimed before it is read.** A settled entry is renamed into this watcher's claim folder
  ``INBOX/.watch-claims/<host>-<pid>-<token>/`` (inside the inbox, so on its filesystem: the rename is
  atomic). Of two watchers on one inbox exactly one rename succeeds; the other finds the entry gone and
  skips it without a line (the winner writes it). The rename goes through folder descriptors opened
  without following links, so a subfolder swapped for a link cannot pull a file from outside the inbox.
- **Never read outside the inbox.** A symbolic link (to a file or a folder, pointing anywhere) is never
  followed: the link itself moves to ``failed/`` with a line naming its target, and nothing but claimed
  regular files is scored or copied to ``review/`` (the review copy is read from the claimed file itself).
- **Not a regular file**: a FIFO, socket or device moves to ``failed/`` with a line saying what it is; it
  is never opened (a FIFO with no writer would block the watcher forever).
- **Hidden entries** (a name starting with '.') stay where they are, with one "skipped" line per version
  of the file: a copy in progress under a temporary name (rsync, many uploaders) is renamed when
  complete, and moving it would break that rename. Hidden folders are not entered.
- **Any exception** while reading, decoding or scoring one file is that file's error row
  (``serving.files.score_files``); the file moves to ``failed/`` and the watcher goes on. A file that
  vanishes before it is claimed is skipped; one that vanishes after gets an error row.
- **No crash loop.** Each watcher holds an exclusive ``flock`` on its claim folder while it lives. A
  watcher that dies while scoring (a decoder crash, the OOM killer, SIGKILL) leaves its claims behind;
  the next scan of any watcher finds that folder unlocked and scores those files again, one at a time. A
  file found in a dead watcher's retries, i.e. one that was being scored alone when a watcher died,
  moves to ``failed/`` unscored: a file that kills the process cannot kill every restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import itertools
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from serving.card import file_kind
from serving.files import score_files, skipped
from serving.review import ReviewQueue, ReviewRule
from serving.runner import Prediction, Runner, RunnerError

log = logging.getLogger(__name__)

try:  # optional: without watchdog the loop polls the inbox
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer
except ImportError:  # pragma: no cover
    FileSystemEventHandler, Observer = object, None

CLAIMS = ".watch-claims"  # the claim folders inside the inbox (hidden: no watcher scores them as images)
RETRY = "retry"  # inside a claim folder: files recovered from a dead watcher, scored one at a time
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Wake(FileSystemEventHandler):
    """Sets ``event`` on any file event in the watched folder, so the loop rescans at once."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__()
        self.event = event

    def on_any_event(self, event) -> None:
        self.event.set()


@dataclass(frozen=True)
class Entry:
    """One entry of the inbox as a scan saw it (never following a link)."""

    path: Path
    rel: str  # relative to the inbox, '/'-separated
    key: tuple[int, int, int]  # (inode, size, mtime_ns): a changed entry is a new version
    left: str = ""  # why it stays in the inbox ('' : it is claimed once settled)


def _short(name: str) -> str:
    """``name``, or only its extension when it is too long to carry a claim prefix within NAME_MAX."""
    return name if len(os.fsencode(name)) <= 200 else Path(name).suffix[-20:]


def _is_alive_claim(folder_fd: int) -> bool:
    """Whether a watcher holds this claim folder (its flock): False means its owner died."""
    try:
        fcntl.flock(folder_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


class Claims:
    """This watcher's claim folder (see the module docstring): entries renamed in, then moved out."""

    def __init__(self, inbox: Path) -> None:
        self.inbox, self.root = inbox, inbox / CLAIMS
        self.counter = itertools.count()
        self.fd = -1
        self.open()

    def open(self) -> None:
        """A new claim folder, locked before it gets its final name (a recovering watcher skips 'tmp-')."""
        if os.path.lexists(self.root) and (self.root.is_symlink() or not self.root.is_dir()):
            raise RunnerError(
                f"{self.root}: exists and is not a folder; move it away (the watcher keeps its claims there)"
            )
        self.root.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=self.root))
        fd = os.open(tmp, DIR_FLAGS)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
        self.path = self.root / f"{host}-{os.getpid()}-{tmp.name[4:]}"
        os.rename(tmp, self.path)
        os.mkdir(RETRY, dir_fd=fd)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd

    def check(self) -> None:
        """Reopen the claim folder when someone removed or replaced it (its name no longer leads to it)."""
        try:
            same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            log.warning("%s: the claim folder was removed or replaced; opening a new one", self.path)
            self.open()

    def take(self, rel: str) -> str | None:
        """Rename the inbox entry ``rel`` into the claim folder; its name there, or None when it is gone
        (another watcher claimed it, or someone removed it). Other failures raise OSError."""
        *folders, name = rel.split("/")
        fd = os.open(self.inbox, DIR_FLAGS)
        try:
            for part in folders:  # without following links: a folder swapped for one is refused (ELOOP)
                sub = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = sub
            claimed = f"{next(self.counter):06d}-{_short(name)}"
            os.rename(name, claimed, src_dir_fd=fd, dst_dir_fd=self.fd)
            return claimed
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def kind(self, name: str) -> tuple[str, str]:
        """What the claimed entry is ('a regular file', 'a FIFO (named pipe)', ...) and a link's target."""
        st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=self.fd) if stat.S_ISLNK(st.st_mode) else ""
        return file_kind(st.st_mode), target

    def path_of(self, name: str) -> Path:
        return self.path / name

    def read(self, name: str) -> bytes:
        """The claimed regular file's bytes (never through a link)."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise OSError(f"{name}: not a regular file")
            return f.read()

    def move_out(self, name: str, target: Path) -> str:
        """Move the claimed entry to ``target`` (a placeholder this watcher created); '' or what happened instead.

        Across filesystems a regular file is copied then removed; a link or FIFO is made again at the target
        (never opened); a socket or device, which cannot be, is removed (it holds no image)."""
        try:
            os.rename(name, target, src_dir_fd=self.fd)
            return ""
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        note = ""
        if stat.S_ISREG(st.st_mode):
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            with os.fdopen(src, "rb") as f, open(target, "wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        elif stat.S_ISLNK(st.st_mode):
            target.unlink()
            os.symlink(os.readlink(name, dir_fd=self.fd), target)
        elif stat.S_ISFIFO(st.st_mode):
            target.unlink()
            os.mkfifo(target)
        else:
            note = f"{file_kind(st.st_mode)} cannot be moved across filesystems: removed"
        os.unlink(name, dir_fd=self.fd)
        return note

    def recover(self) -> tuple[list[str], list[str]]:
        """Take over the claims of dead watchers: (names to score again one at a time, names found in a dead
        watcher's retries), both now in this claim folder (the first under ``retry/``)."""
        retry, dead = [], []
        try:
            folders = sorted(p for p in self.root.iterdir() if not p.name.startswith("tmp-") and p != self.path)
        except OSError:
            return retry, dead
        for folder in folders:
            try:
                fd = os.open(folder, DIR_FLAGS)
            except OSError:  # gone meanwhile (another watcher recovered it), or not a folder
                continue
            try:
                if _is_alive_claim(fd):
                    continue
                retry += self._adopt(fd, "", RETRY + "/")
                with contextlib.suppress(OSError):
                    sub = os.open(RETRY, DIR_FLAGS, dir_fd=fd)
                    try:
                        dead += self._adopt(sub, RETRY + "/", "")
                    finally:
                        os.close(sub)
                    os.rmdir(RETRY, dir_fd=fd)
                with contextlib.suppress(OSError):
                    folder.rmdir()
            finally:
                os.close(fd)
        return retry, dead

    def _adopt(self, fd: int, skip_prefix: str, into: str) -> list[str]:
        """Rename every entry of the dead claim folder ``fd`` (but its retry folder) into ours, under ``into``."""
        names = []
        for name in sorted(os.listdir(fd)):
            if not skip_prefix and name == RETRY:
                continue
            new = f"{into}{next(self.counter):06d}-{name.partition('-')[2] or name}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(name, new, src_dir_fd=fd, dst_dir_fd=self.fd)
                names.append(new)
        return names

    def close(self) -> None:
        """Remove this watcher's claim folder when it is empty (it is, after a clean stop) and release it."""
        with contextlib.suppress(OSError):
            os.rmdir(RETRY, dir_fd=self.fd)
            self.path.rmdir()
        os.close(self.fd)
        self.fd = -1


def reserve(folder: Path, name: str) -> Path:
    """A new empty file ``folder/name`` (or ``stem.1.ext`` ...), created exclusively: two watchers writing
    into one done/ folder never take the same name, and nothing there is overwritten."""
    stem, suffix = Path(name).stem, Path(name).suffix
    for n in itertools.count():
        target = folder / (name if n == 0 else f"{stem}.{n}{suffix}")
        try:
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            return target
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG or len(stem) <= 16:
                raise
            stem, name = stem[:100], stem[:100] + suffix
    raise AssertionError("unreachable")


def _row(p: Prediction, path: Path, rel: str) -> dict[str, Any]:
    return dataclasses.asdict(p) | {"path": str(path), "file": rel}


LINKS = "links are never followed (only regular files inside the inbox are read)"
HIDDEN = "left in the inbox (a copy in progress under a temporary name is renamed when complete)"
DIED_TWICE = (
    "not scored: a watcher died while scoring this file alone, after one had died with it before (a decoder "
    "crash or the memory limit?); a file that kills the process is not retried"
)


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
        Path(inbox).mkdir(parents=True, exist_ok=True)
        self.inbox = Path(inbox).resolve()  # entries are named relative to the real folder
        self.runner, self.results = runner, results
        self.done, self.failed, self.review, self.rule = done, failed, review, rule
        self.settle, self.batch_size = settle, batch_size
        for what, folder in (("done", done), ("failed", failed), ("review", review), ("results", results.parent)):
            real = Path(folder).resolve()
            if real == self.inbox or self.inbox in real.parents:
                raise RunnerError(
                    f"the {what} folder {folder} is inside the inbox {inbox}: its files would be scored again"
                )
        self.seen: dict[Path, tuple[tuple[int, int, int], float]] = {}  # path -> (key, stable since)
        self.reported: dict[Path, tuple[int, int, int]] = {}  # left in the inbox, its line written: path -> key
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.counts = {"done": 0, "failed": 0, "review": 0, "skipped": 0}
        self.queue = ReviewQueue(review)
        for d in (done, failed):
            d.mkdir(parents=True, exist_ok=True)
        results.parent.mkdir(parents=True, exist_ok=True)
        self.claims: Claims | None = None

    def scan(self) -> list[Entry]:
        """Every entry under the inbox, sorted, without following a link; hidden folders and the claim
        folders are not entered, a folder that cannot be listed is an entry of its own."""
        entries, stack = [], [self.inbox]
        while stack:
            folder = stack.pop()
            try:
                with os.scandir(folder) as it:
                    items = list(it)
            except FileNotFoundError:
                continue
            except OSError as exc:
                rel = folder.relative_to(self.inbox).as_posix()
                entries.append(Entry(folder, rel, (0, 0, 0), f"skipped: cannot list this folder ({exc.strerror})"))
                continue
            for e in items:
                if folder == self.inbox and e.name == CLAIMS:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:  # vanished between the listing and now
                    continue
                path, is_dir = Path(e.path), stat.S_ISDIR(st.st_mode)
                rel, key = path.relative_to(self.inbox).as_posix(), (st.st_ino, st.st_size, st.st_mtime_ns)
                if e.name.startswith("."):
                    what = "a hidden folder, not entered" if is_dir else "a hidden file"
                    entries.append(Entry(path, rel, (st.st_ino, 0, 0) if is_dir else key, f"skipped: {what}; {HIDDEN}"))
                elif is_dir:
                    stack.append(path)
                else:
                    entries.append(Entry(path, rel, key))
        return sorted(entries, key=lambda e: e.rel)

    def settled(self, entries: list[Entry]) -> list[Entry]:
        """The entries whose (inode, size, mtime) have been unchanged for ``settle`` seconds."""
        now, ready, present = time.monotonic(), [], {e.path for e in entries}
        for e in entries:
            before = self.seen.get(e.path)
            if before is None or before[0] != e.key:
                self.seen[e.path] = (e.key, now)
            elif now - before[1] >= self.settle:
                ready.append(e)
        self.seen = {p: v for p, v in self.seen.items() if p in present}
        self.reported = {p: k for p, k in self.reported.items() if p in present}
        return ready

    def pending(self) -> bool:
        """Whether an entry in the inbox still waits for its line (hidden ones, once reported, do not)."""
        return any(self.reported.get(p) != key for p, (key, _) in self.seen.items())

    def step(self) -> bool:
        """One scan: recover dead watchers' claims, report what stays, claim and score up to a batch.
        Returns whether there was anything to do."""
        claims = self.claims
        claims.check()
        retry, dead = claims.recover()
        ready = [e for e in self.settled(self.scan()) if self.reported.get(e.path) != e.key]
        left, todo = [e for e in ready if e.left], [e for e in ready if not e.left][: self.batch_size]
        if not (retry or dead or left or todo):
            return False
        with open(self.results, "a") as out:
            for name in dead:
                self.finish(out, name, _rel(name), skipped(claims.path_of(name), DIED_TWICE), "failed")
            for name in retry:  # one at a time: one of them may be what killed the last watcher
                self.score(out, [(_rel(name), name)], batch_size=1)
            for e in left:
                self.write(out, _row(skipped(e.path, e.left), e.path, e.rel) | {"moved_to": "", "skipped": True})
                self.reported[e.path] = e.key
                self.counts["skipped"] += 1
            claimed = []
            for e in todo:
                try:
                    name = claims.take(e.rel)
                except OSError as exc:  # cannot move it out of the inbox: one line, not retried until it changes
                    self.write(out, _row(skipped(e.path, f"cannot claim it: {exc}"), e.path, e.rel) | {"moved_to": ""})
                    self.reported[e.path] = e.key
                    self.counts["failed"] += 1
                    continue
                self.seen.pop(e.path, None)
                if name is not None:  # None: another watcher took it first (it writes the line), or it vanished
                    claimed.append((e.rel, name))
            self.score(out, claimed)
        return True

    def score(self, out: IO[str], claimed: list[tuple[str, str]], batch_size: int = 0) -> None:
        """Score the claimed regular files; refuse links and other entries that are not regular files."""
        paths: dict[str, tuple[str, str]] = {}
        for rel, name in claimed:
            try:
                kind, target = self.claims.kind(name)
            except FileNotFoundError:
                self.write(out, _row(skipped(self.inbox / rel, "vanished after it was claimed"), self.inbox / rel, rel))
                self.counts["failed"] += 1
                continue
            if target:
                why = f"refused: a symbolic link to {target!r}; {LINKS}"
            elif kind != "a regular file":
                why = f"skipped: {kind}, not a regular file; never opened"
            if target or kind != "a regular file":
                self.finish(out, name, rel, skipped(self.inbox / rel, why), "skipped")
                continue
            paths[str(self.claims.path_of(name))] = (rel, name)
        for p in score_files(self.runner, list(paths), batch_size or self.batch_size):
            rel, name = paths[p.path]
            self.finish(out, name, rel, p)

    def finish(self, out: IO[str], name: str, rel: str, p: Prediction, counted: str = "") -> None:
        """The result line (flushed), the review copy, then the claimed entry moves to done/ or failed/."""
        claimed, original = str(self.claims.path_of(name)), self.inbox / rel
        row = _row(p, original, rel) | {"error": p.error.replace(claimed, str(original))}
        ok = not p.error
        if ok:
            reasons = self.rule.reasons(p.defect_score, p.probs, self.runner.card.threshold)
            if reasons:
                try:  # the copy is read from the claimed file itself, never through a link
                    self.queue.add(self.claims.read(name), Path(rel).name, p.label, row, reasons)
                    row["review_reasons"] = reasons
                    self.counts["review"] += 1
                except OSError as exc:
                    row["review_error"] = str(exc)
        target = reserve(self.done if ok else self.failed, Path(rel).name)
        self.write(out, row | {"moved_to": str(target)} | ({"skipped": True} if counted == "skipped" else {}))
        try:
            note = self.claims.move_out(name, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                if target.stat().st_size == 0:
                    target.unlink()  # our own empty placeholder
            note = f"could not be moved to {target}: {exc}"
        if note:
            self.write(out, {"path": str(original), "file": rel, "error": note, "moved_to": ""})
        self.counts[counted or ("done" if ok else "failed")] += 1

    @staticmethod
    def write(out: IO[str], row: dict[str, Any]) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()  # the result is on disk before the image leaves the claim folder

    def run(self, once: bool = False, poll: float = 0.5) -> dict[str, int]:
        """Watch until stopped (or, with ``once``, until every entry has its line); return the counts."""
        observer = None
        if not once and Observer is None:
            log.warning("watchdog is not installed: polling the inbox every %.1f s", poll)
        elif not once:
            observer = Observer()
            observer.schedule(_Wake(self.wake), str(self.inbox), recursive=True)
            observer.start()
        log.info("watching %s (results: %s)", self.inbox, self.results)
        self.claims = Claims(self.inbox)
        try:
            while not self.stop.is_set():
                try:
                    if self.step():
                        continue
                except Exception:  # noqa: BLE001 (the loop's safety net: log, wait, scan again)
                    if once:
                        raise
                    log.exception("watch: scanning %s failed; trying again in %.1f s", self.inbox, poll)
                    self.stop.wait(poll)
                    continue
                if once and not self.pending():
                    break
                self.wake.wait(min(poll, self.settle / 2) if self.pending() else poll)
                self.wake.clear()
        finally:
            if observer is not None:
                observer.stop()
                observer.join()
            self.claims.close()
        return self.counts


def _rel(name: str) -> str:
    """A recovered claim's name in the inbox (its folder is not kept): ``retry/000012-a.png`` -> ``a.png``."""
    base = Path(name).name
    return base.partition("-")[2] or base
