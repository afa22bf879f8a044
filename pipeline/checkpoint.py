"""Checkpoints: plain versioned dicts of tensors and numbers, written atomically, read with weights_only.

A crash (or SIGKILL) while writing leaves the previous checkpoint intact: the bytes go to a temp file
in the same folder, are fsynced, and only then renamed over the old name (rename is atomic on POSIX).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
CHECKPOINT_VERSION = 1


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``, or None (with the reason logged) when it is missing or unreadable."""
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
