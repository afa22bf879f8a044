"""Distributed training with the standard launcher: one process per GPU (or CPU worker), via torchrun.

``train.distributed: ddp`` wraps the model in DistributedDataParallel; ``fsdp`` shards parameters,
gradients and optimizer state with ``torch.distributed.fsdp.fully_shard`` (FSDP2). Both use NCCL on
CUDA and gloo on CPU. ``Dist`` carries rank and world size so the rest of the code asks
``dist.is_main`` instead of reading environment variables, and works unchanged with one process.

The train stage stays one command: ``python stages/train.py`` re-launches itself through
``torch.distributed.run`` (torchrun) when ``train.distributed`` is not ``none``. On a cluster, run
torchrun yourself on every node; the stage sees ``LOCAL_RANK`` and does not launch again:

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint head:29400 stages/train.py
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.fsdp import fully_shard

log = logging.getLogger(__name__)


def under_launcher() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the torch env contract)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_command(script: str, processes: int) -> list[str]:
    """The torchrun command that runs ``script`` in ``processes`` local processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        script,
    ]


def relaunch(script: str, processes: int) -> int:
    """Run ``script`` again under torchrun in ``processes`` local processes; their exit code."""
    cmd = launch_command(script, processes)
    log.info("launching %d processes: %s", processes, " ".join(cmd))
    return subprocess.call(cmd)


@dataclass
class Dist:
    mode: str  # none | ddp | fsdp
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            tdist.all_reduce(t)
            t /= self.world_size
        return t

    def close(self) -> None:
        if self.enabled and tdist.is_initialized():
            tdist.destroy_process_group()


def init(mode: str, device_type: str) -> Dist:
    """Join the process group torchrun set up (``mode`` none: a single process, nothing to join)."""
    if mode == "none":
        return Dist("none")
    if not under_launcher():
        raise RuntimeError(f"train.distributed: {mode} must run under torchrun (stages/train.py launches it)")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local)
    tdist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    log.info("process group: %s rank %d of %d (%s)", mode, rank, world, backend)
    return Dist(mode, rank, world, local)


def wrap(model: nn.Module, d: Dist, device: torch.device) -> nn.Module:
    """DDP or FSDP2 around ``model`` (already on ``device``); the module itself when not distributed."""
    if d.mode == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if d.mode == "fsdp":
        # Shard each block group on its own (its parameters are gathered just before it runs and freed
        # after), then the root for the stem and head. Works for timm EfficientNets and any model with
        # a ``blocks`` sequence; others are sharded as one unit.
        blocks = getattr(getattr(model, "backbone", model), "blocks", None)
        for block in blocks or []:
            fully_shard(block)
        fully_shard(model)
        return model
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def average_batchnorm_stats(model: nn.Module, d: Dist) -> None:
    """Average BatchNorm running statistics over ranks (each rank saw other images), as timm does."""
    if not d.enabled:
        return
    for name, buf in unwrap(model).named_buffers():
        if name.endswith(("running_mean", "running_var")):
            d.all_reduce_mean_(buf.data)
