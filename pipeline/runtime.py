"""Device and precision, resolved once; the training loop then has a single code path.

``autocast()`` is a no-op context and ``scaler`` a disabled GradScaler when mixed precision is off,
so the loop never branches on the device. On CPU, bf16 autocast is used only where the processor has
native bf16 (AVX512-BF16 or AMX): on an AVX2-only CPU it made EfficientNet training ~10x slower.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype | None  # autocast dtype, None = fp32
    scaler: torch.amp.GradScaler

    @property
    def precision(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)


def resolve_runtime(device: str = "auto", precision: str = "auto") -> Runtime:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device: cuda was asked for but torch sees no CUDA device")
    dev = torch.device(device)
    if precision == "auto":
        if dev.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if cpu_has_native_bf16() else "fp32"
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    if dtype is torch.float16 and dev.type == "cpu":
        raise RuntimeError("train.precision: fp16 autocast is for CUDA; use bf16 or fp32 on CPU")
    # fp16 needs loss scaling to keep small gradients from underflowing; bf16 has fp32's range.
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype is torch.float16)
    rt = Runtime(dev, dtype, scaler)
    log.info("runtime: device=%s precision=%s", dev, rt.precision)
    return rt
