"""One owner of a training run's checkpoint state (timm's ``CheckpointSaver`` is the model).

``Checkpointer`` holds what a resumed run needs to continue exactly where the killed one was: model,
optimizer, LR schedule, loss scaler, EMA weights, epoch and step inside the epoch, each rank's RNG
state and running sums, the best monitored val score, the early-stopping count, history, the MLflow
run id and the fingerprint of the params, code and data. It writes the resume points (``save``), reads
the newest good one back (``resume``), and keeps the ``keep_best`` best consolidated models
(``keep_best``). The files themselves are ``pipeline.checkpoint``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pipeline import checkpoint
from pipeline.config import ConfigError
from pipeline.distributed import Dist, unwrap
from pipeline.model import save_model
from pipeline.runtime import Runtime
from pipeline.training.loop import EMA, EpochProgress

log = logging.getLogger(__name__)


def new_state() -> dict[str, Any]:
    """The run's progress beside the tensors; saved as top-level keys of every checkpoint."""
    return {
        "epoch": 0,  # epochs completed
        "global_step": 0,
        "best": None,  # best monitor score so far (higher is better)
        "bad_epochs": 0,  # epochs since it improved (early stopping)
        "stopped_early": False,
        "best_models": [],  # [[monitor score, file name], ...] consolidated best models kept, best first
        "history": [],
        "run_id": None,
    }


def rng_state(rt: Runtime) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if rt.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(rt.device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], rt: Runtime) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and rt.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], rt.device)


def local_buffers(model: nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """This rank's own buffers (BatchNorm statistics) when ranks differ: until they are averaged at the
    end of an epoch, each rank's running statistics saw its own images, and a checkpoint of rank 0's
    alone would change the other ranks' on resume."""
    if not d.enabled:
        return {}
    names = ("running_mean", "running_var", "num_batches_tracked")
    return {n: b.detach().cpu().clone() for n, b in unwrap(model).named_buffers() if n.endswith(names)}


def set_local_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    own = dict(unwrap(model).named_buffers())
    with torch.no_grad():
        for n, t in buffers.items():
            own[n].copy_(t)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA) -> dict[str, Any]:
    """FSDP: the model and optimizer state dicts as shards (DTensors) plus the EMA shards, for DCP."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "ema": ema.shadow}


class Checkpointer:
    """The checkpoints of one training run (rank-collective where distributed; rank 0 writes)."""

    def __init__(
        self,
        root: Path,
        fingerprint: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        ema: EMA,
        rt: Runtime,
        d: Dist,
        keep_last: int,
        keep_best: int,
    ) -> None:
        self.store = checkpoint.CheckpointDir(root, d, keep_last)
        self.root, self.fingerprint, self.keep_best_n = root, fingerprint, keep_best
        self.model, self.optimizer, self.scheduler, self.ema, self.rt, self.d = model, optimizer, scheduler, ema, rt, d
        self.state = new_state()

    def resume(self, on_mismatch: str) -> EpochProgress:
        """Continue from the newest good checkpoint, if any: load its tensors and state, return where this
        rank was inside the epoch (a fresh ``EpochProgress`` when starting over)."""
        found = self._load(on_mismatch)
        if found is None:
            return EpochProgress()
        saved, where = found
        self.scheduler.load_state_dict(saved["scheduler"])
        self.rt.scaler.load_state_dict(saved["scaler"])
        d = self.d
        mine = saved["ranks"][d.rank] if d.rank < len(saved["ranks"]) else saved["ranks"][0]
        set_rng_state(mine["rng"], self.rt)
        set_local_buffers(self.model, mine["buffers"])
        progress = EpochProgress(**mine["progress"])
        self.state = {k: saved[k] for k in self.state}
        s = self.state
        log.info(
            "resuming from %s after epoch %d, step %d (%d steps done)",
            where,
            s["epoch"],
            progress.step,
            s["global_step"],
        )
        return progress

    def _load(self, on_mismatch: str) -> tuple[dict, Path] | None:
        """Load model, optimizer and EMA from the newest good checkpoint; return its state and folder.

        A checkpoint made from other params or data is not resumed silently: with ``on_mismatch: stop``
        the stage stops; with ``restart`` it says so, moves the old checkpoints to ``superseded/`` and
        starts fresh.
        """
        store, d = self.store, self.d
        store.clean_unfinished()
        steps = store.steps()
        if not steps:
            return None
        newest = checkpoint.load(steps[0] / "state.pt")
        if newest is not None and newest["fingerprint"] != self.fingerprint:
            self._supersede(steps[0], newest["fingerprint"], on_mismatch)
            return None
        if d.mode == "fsdp":
            template = sharded_state(self.model, self.optimizer, self.ema)
            found = store.load_latest(template, newest)
            if found is not None:
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=template["model"],
                    optim_state_dict=template["optimizer"],
                )
                self.ema.updates = found[0]["ema_updates"]
        else:
            found = store.load_latest(newest=newest)
            if found is not None:
                saved = found[0]
                unwrap(self.model).load_state_dict(saved["model"])
                self.optimizer.load_state_dict(saved["optimizer"])
                self.ema.load_state_dict(saved["ema"])
        if found is None:
            log.warning("no usable checkpoint in %s: starting fresh", store.root)
        return found

    def _supersede(self, newest: Path, old_fingerprint: str, on_mismatch: str) -> None:
        where = (
            f"{newest} was trained on other params, code, data or warm start (fingerprint "
            f"{old_fingerprint[:12]}, now {self.fingerprint[:12]})"
        )
        if on_mismatch == "stop":
            raise ConfigError(f"checkpoint {where}; stopping (train.on_mismatch: stop). Move it away to start fresh")
        log.warning("checkpoint %s: starting fresh; the old checkpoints move to %s", where, self.root / "superseded")
        if self.d.is_main:
            old = self.root / "superseded"
            shutil.rmtree(old, ignore_errors=True)
            old.mkdir()
            for p in list(self.root.iterdir()):
                if p != old:
                    p.rename(old / p.name)
        self.d.barrier()

    def save(self, progress: EpochProgress) -> None:
        """A resume point at this rank's ``progress`` (collective: every rank's RNG and sums are gathered)."""
        d, rt = self.d, self.rt
        ranks = d.all_gather_object(
            {"rng": rng_state(rt), "progress": progress.as_dict(), "buffers": local_buffers(self.model, d)}
        )
        body = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": rt.scaler.state_dict(),
            "fingerprint": self.fingerprint,
            "world_size": d.world_size,
            "ranks": ranks,
            **self.state,
        }
        if d.mode == "fsdp":
            body["ema_updates"] = self.ema.updates  # the EMA weights themselves are among the shards
            self.store.save(self.state["global_step"], body, sharded_state(self.model, self.optimizer, self.ema))
        else:
            body |= {
                "model": unwrap(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "ema": self.ema.state_dict(),
            }
            self.store.save(self.state["global_step"], body)

    def keep_best(self, weights: dict, meta: dict, score: list[float]) -> None:
        """Write the consolidated model of this epoch and keep only the ``keep_best`` best-scoring ones."""
        name = f"best-epoch{meta['epoch']:03d}.pt"
        save_model(weights, meta, self.root / name)
        ranked = sorted([*(b for b in self.state["best_models"] if b[1] != name), [score, name]], reverse=True)
        for _, dropped in ranked[self.keep_best_n :]:
            (self.root / dropped).unlink(missing_ok=True)
        self.state["best_models"] = ranked[: self.keep_best_n]

    def best_model(self) -> Path:
        return self.root / self.state["best_models"][0][1]
