"""Side-by-side timing: the edge runner (onnxruntime) vs PyTorch eager on the same model and images.

Machines here are shared and noisy, so every comparison is interleaved (runner, torch, runner, torch,
...) in one process and reported as medians with the spread, plus the ratio of the medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summarize(seconds: list[float], images_per_call: int) -> dict:
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": p99,
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "img_s": images_per_call / (statistics.median(ms) / 1000),
        "calls": len(ms),
    }


def interleaved(
    contenders: dict[str, Callable[[], object]], images_per_call: int, repeats: int, warmup: int, rounds: int = 5
) -> dict[str, dict]:
    """Run each contender ``warmup`` times, then ``rounds`` alternating rounds of ``repeats // rounds`` calls."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name] += time_calls(fn, per_round)
    return {name: summarize(s, images_per_call) for name, s in samples.items()}


def batches(images: np.ndarray, batch_size: int) -> np.ndarray:
    """A (batch_size, H, W, C) batch drawn from images, repeating them when there are too few."""
    idx = np.arange(batch_size) % len(images)
    return np.ascontiguousarray(images[idx])
