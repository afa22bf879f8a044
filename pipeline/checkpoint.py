"""Checkpoints: written atomically, read with ``weights_only=True``, the last few kept.

A training checkpoint is a folder ``step-00000123/`` in the checkpoint directory:

- ``state.pt``: everything that is not sharded (scheduler, scaler, progress, RNG states of every
  rank, history, MLflow run id, fingerprint) and, without FSDP, the model, optimizer and EMA too;
- ``shards/`` (FSDP only): model, optimizer and EMA shards written by every rank through
  ``torch.distributed.checkpoint``, which can also re-shard them for another process count.

The folder is written under a temporary name (``.step-00000123.tmp``), its files fsynced, and only
then renamed: a SIGKILL during the write leaves a temporary folder that the next run removes, and
the previous checkpoints untouched. Resume walks the folders newest first and takes the first one
that loads, so a corrupt or truncated newest checkpoint costs a few steps, not the run.

Single-file saves (the consolidated models that evaluate and export read) use the same
temp-file, fsync, rename sequence through ``save_atomic``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from pipeline.distributed import Dist

log = logging.getLogger(__name__)
CHECKPOINT_VERSION = 2
STEP_DIR = re.compile(r"^step-(\d{8})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # make the rename itself durable
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> dict[str, Any] | None:
    """The file at ``path``, or None (with the reason logged) when it is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated or corrupt file: report it, let the caller fall back
        log.warning("checkpoint %s is unreadable (%s); ignoring it", path, exc)
        return None
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        log.warning("checkpoint %s has an unknown format version; ignoring it", path)
        return None
    return ckpt


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def step_dirs(root: Path) -> list[Path]:
    """The complete checkpoint folders under ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


class CheckpointDir:
    """The training checkpoints of one run: save, list, load newest-good, prune to ``keep``."""

    def __init__(self, root: Path, d: Dist, keep: int) -> None:
        self.root, self.d, self.keep = root, d, keep

    def steps(self) -> list[Path]:
        return step_dirs(self.root)

    def clean_unfinished(self) -> None:
        """Remove temporary folders of writes that were killed half way (rank 0, before anything else)."""
        if self.d.is_main and self.root.is_dir():
            for p in self.root.glob(".step-*.tmp"):
                log.warning("removing %s: a checkpoint write that did not finish", p)
                shutil.rmtree(p, ignore_errors=True)
        self.d.barrier()

    def save(self, step: int, state: dict[str, Any], sharded: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` (collective when distributed); prune older ones beyond ``keep``."""
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".{final.name}.tmp"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.d.barrier()
        if sharded is not None:
            dcp.save(sharded, checkpoint_id=str(tmp / "shards"))
        if self.d.is_main:
            torch.save({"version": CHECKPOINT_VERSION, **state}, tmp / "state.pt")
        self.d.barrier()
        if self.d.is_main:
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)  # a rerun of the same step replaces it
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in self.steps()[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
        self.d.barrier()
        return final

    def load_latest(
        self, sharded_template: dict[str, Any] | None = None, newest: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads on every rank: (state, folder), or None if there is none.

        With FSDP, ``sharded_template`` (the live sharded state dicts) is filled in place. ``newest``:
        the newest folder's ``state.pt`` when the caller has read it already (it is not read twice).
        """
        for i, path in enumerate(self.d.broadcast_object(self.steps())):
            state = newest if i == 0 and newest is not None else load(path / "state.pt")
            ok = state is not None
            if ok and sharded_template is not None:
                try:
                    dcp.load(sharded_template, checkpoint_id=str(path / "shards"))
                except Exception as exc:
                    log.warning("checkpoint %s: shards unreadable (%s); ignoring it", path, exc)
                    ok = False
            if all(self.d.all_gather_object(ok)):
                return state, path
            log.warning("checkpoint %s is unusable; trying the one before it", path)
        return None
