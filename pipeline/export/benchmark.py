"""The benchmark driver shared by the benchmark stage and ``make bench`` (benchmarks/bench.py): the edge
runner (each exported variant) against PyTorch eager (and ``torch.compile``) on the same model and
images, interleaved, plus end to end from image files and the HTTP server against the runner in process.
With a tile model both sides score photographs at full resolution (whole view and tiles, fused)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.config import BenchmarkConfig
from pipeline.data.prepare import load_split
from pipeline.export.reference import torch_scorer
from pipeline.export.timing import (
    as_jpeg,
    batches,
    end_to_end,
    http_vs_in_process,
    interleaved,
    photographs,
    variant_files,
)
from pipeline.model import load_model, load_tile_model
from pipeline.plots import benchmark_plot
from serving.runner import Runner

EAGER = "torch eager"


@dataclass(frozen=True)
class Inputs:
    """Where the benchmark reads (dvc.yaml deps; ``make bench --project`` points them at another folder)."""

    root: Path = Path(".")

    @property
    def export(self) -> Path:
        return self.root / "models/export"

    @property
    def model(self) -> Path:
        return self.root / "models/train/model.pt"

    def test_images(self, limit: int) -> tuple[np.ndarray, list[Path]]:
        """The first ``limit`` prepared test images (N, S, S, C) uint8 and their files."""
        x, _, paths = load_split(self.root / "data/prepared", "test")
        return x[:limit], [self.root / "data/raw/images" / p for p in paths[:limit]]


def runners(export_dir: Path, only_deployable: bool = False) -> dict[str, Runner]:
    """One in-process runner per exported variant, CPU provider. spin=False: a busy-waiting onnxruntime
    thread pool would starve PyTorch in the interleaved rounds."""
    out = {v: Runner(f, providers="cpu", spin=False, force=True) for v, f in variant_files(export_dir).items()}
    return {v: r for v, r in out.items() if v == "fp32" or r.card.deployable or not only_deployable}


def contenders(rs: dict[str, Runner], src: Inputs, compile_: bool = False) -> tuple[dict[str, Callable], str]:
    """``runner <variant>`` and PyTorch (``torch eager``, and ``torch.compile`` where asked and it builds),
    each scoring a batch of what the runner takes; and a note on the compile."""
    net, _ = load_model(src.model)
    tiles = load_tile_model(src.model)
    card = rs["fp32"].card
    out: dict[str, Callable] = {f"runner {v}": (lambda b, r=r: r.predict(b)) for v, r in rs.items()}
    out[EAGER] = torch_scorer(net, tiles and tiles[0], card)
    if not compile_:
        return out, "skipped"
    try:  # inductor on the CPU needs a C++ compiler; where it cannot build, say so and go on
        compiled = torch_scorer(torch.compile(net), tiles and torch.compile(tiles[0]), card)
        t0 = time.perf_counter()
        for bs in (1, 8, 32):
            compiled(np.zeros((bs, card.input.size, card.input.size, card.input.channels), np.uint8))
        out["torch.compile"] = compiled
        return out, f"compiled in {time.perf_counter() - t0:.0f} s"
    except Exception as exc:  # noqa: BLE001
        return out, f"torch.compile failed here: {type(exc).__name__}: {str(exc)[:200]}"


def compare(fns: dict[str, Callable], x: np.ndarray, batch_sizes: list[int], repeats: int, warmup: int) -> dict:
    """Every contender at every batch size, interleaved; ``vs_eager``: PyTorch eager's p50 over its own."""
    report = {}
    for bs in batch_sizes:
        batch = batches(x, bs)
        res = interleaved({k: (lambda f=f, b=batch: f(b)) for k, f in fns.items()}, bs, repeats, warmup)
        for k in res:
            res[k]["vs_eager"] = res[EAGER]["p50_ms"] / res[k]["p50_ms"]
        report[f"batch_{bs}"] = res
        print(
            f"benchmark batch {bs}: "
            + ", ".join(f"{k} {r['p50_ms']:.1f} ms ({r['vs_eager']:.2f}x)" for k, r in res.items())
        )
    return report


def inputs_of(rs: dict[str, Runner], x: np.ndarray, files: list[Path]) -> tuple[np.ndarray, str]:
    """What both sides score: the prepared images, or with tiles the photographs at full resolution."""
    card = rs["fp32"].card
    if not card.tiles:
        return x, f"prepared test images, {x.shape[1]} px"
    x = photographs(rs["fp32"], files)
    return x, (
        f"photographs with tiles: {len(x)} test photographs of {x.shape[2]}x{x.shape[1]} px (the most "
        f"common size), the whole view and {card.tiles.size} px tiles fused, in the runner and in PyTorch "
        "eager"
    )


def files_end_to_end(rs: dict[str, Runner], files: list[Path], rounds: int, batch: int) -> dict:
    """Images/s from PNG files and from the same images as JPEG (as most line cameras send them)."""
    with tempfile.TemporaryDirectory() as tmp:
        jpegs = as_jpeg(files, Path(tmp))
        return end_to_end(rs, {"png": files, "jpeg": jpegs}, rounds, batch)


def run_benchmark(cfg: BenchmarkConfig, src: Inputs, out: Path) -> dict:
    """The benchmark stage: latency per batch size, end to end from files, HTTP vs in process."""
    rs = runners(src.export)
    x, files = src.test_images(cfg.max_images)
    x, described = inputs_of(rs, x, files)
    print(f"benchmark: inputs: {described}")
    fns, _ = contenders(rs, src)
    report: dict = {
        "inputs": described,
        "providers": rs["fp32"].providers,
        "torch_threads": torch.get_num_threads(),
        "deployable": {v: r.card.deployable for v, r in rs.items()},
        "input_size": rs["fp32"].card.input.size,
    }
    report |= compare(fns, x, cfg.batch_sizes, cfg.repeats, cfg.warmup)
    report["end_to_end"] = files_end_to_end(rs, files, cfg.rounds, max(cfg.batch_sizes))
    recommended = rs["fp32"].card.recommended.get("cpu", "fp32")
    http_model = variant_files(src.export).get(recommended, src.export / "model.onnx")
    report["http"] = http_vs_in_process(
        http_model, x[:64], files[:64], cfg.http_concurrency, cfg.http_seconds, cfg.rounds
    )
    out.mkdir(parents=True, exist_ok=True)
    benchmark_plot(report, out / "benchmark.png")
    return report


def flat_metrics(report: dict, batch_sizes: list[int]) -> dict[str, float]:
    """The headline figures of the report as MLflow metrics, a few where the full report is one artifact
    (``benchmark/metrics.json``): at the smallest batch each contender's ``bench_b<bs>_<contender>_p50_ms``
    and ``_vs_eager`` (PyTorch eager's p50 over its own), at the largest its ``_img_s``; end to end from
    JPEG files ``bench_e2e_<variant>_jpeg_img_s``; the HTTP server's ``bench_http_infer_img_s``, its p99 and
    its share of the in-process rate."""
    flat = {}
    low, high = min(batch_sizes), max(batch_sizes)
    for c, r in report[f"batch_{low}"].items():
        name = c.replace(" ", "_").replace(".", "_")
        flat[f"bench_b{low}_{name}_p50_ms"] = r["p50_ms"]
        if c != EAGER:
            flat[f"bench_b{low}_{name}_vs_eager"] = r["vs_eager"]
    for c, r in report[f"batch_{high}"].items():
        flat[f"bench_b{high}_{c.replace(' ', '_').replace('.', '_')}_img_s"] = r["img_s"]
    flat |= {f"bench_e2e_{v}_jpeg_img_s": r["jpeg_img_s"] for v, r in report["end_to_end"].items() if "jpeg_img_s" in r}
    http = report["http"]
    flat |= {f"bench_http_{k}": http[k] for k in ("infer_img_s", "infer_p99_ms", "infer_vs_in_process") if k in http}
    return flat


def summary_line(report: dict) -> str:
    h, b1 = report["http"], report[f"batch_{min(int(k.split('_')[1]) for k in report if k.startswith('batch_'))}"]
    best = max((k for k in b1 if k.startswith("runner")), key=lambda k: b1[k]["vs_eager"])
    return (
        f"benchmark: {best} {b1[best]['p50_ms']:.1f} ms ({b1[best]['vs_eager']:.2f}x eager); HTTP "
        f"({h['variant']}, {h['concurrency']} clients) {h['infer_img_s']:.0f} img/s vs "
        f"{h['in_process_img_s']:.0f} in process ({h['infer_vs_in_process']:.2f})"
    )
