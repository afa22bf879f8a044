"""Stage benchmark: the edge runner vs PyTorch eager on the same model and test images, interleaved."""

import json
import time
from pathlib import Path

import torch

from pipeline import tracking
from pipeline.bench import batches, interleaved
from pipeline.entry import run_stage
from pipeline.prepare import load_split
from pipeline.train import load_model
from serving.runner import Runner


def main(params):
    cfg = params.benchmark
    x_test, _, paths = load_split(Path("data/prepared"), "test")
    x_test, paths = x_test[: cfg.max_images], paths[: cfg.max_images]
    runner = Runner("models/export/model.onnx", providers="cpu", spin=False)  # spinning would starve torch
    net, _ = load_model(Path("models/train/model.pt"))

    def eager(batch):
        with torch.inference_mode():
            return net(torch.from_numpy(batch)).softmax(1)

    report = {"providers": runner.providers, "torch_threads": torch.get_num_threads()}
    for bs in cfg.batch_sizes:
        batch = batches(x_test, bs)
        res = interleaved(
            {"runner": lambda b=batch: runner.predict(b), "torch_eager": lambda b=batch: eager(b)},
            bs,
            cfg.repeats,
            cfg.warmup,
        )
        res["speedup_p50"] = res["torch_eager"]["p50_ms"] / res["runner"]["p50_ms"]
        report[f"batch_{bs}"] = res
        print(
            f"benchmark: batch {bs}: runner {res['runner']['p50_ms']:.1f} ms, torch eager "
            f"{res['torch_eager']['p50_ms']:.1f} ms p50 -> {res['speedup_p50']:.2f}x"
        )
    # End to end from image files on disk: decode + resize + inference, as the runner does in production.
    files = [Path("data/raw/images") / p for p in paths]
    t0 = time.perf_counter()
    n = sum(1 for r in runner.predict_files(files, batch_size=max(cfg.batch_sizes)) if not r.error)
    report["end_to_end_img_s"] = n / (time.perf_counter() - t0)
    out = Path("reports/benchmark")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    flat = {
        f"bench_{k}_{c}_{m}": v[c][m]
        for k, v in report.items()
        if k.startswith("batch_")
        for c in ("runner", "torch_eager")
        for m in ("p50_ms", "img_s")
    }
    flat |= {f"bench_{k}_speedup": v["speedup_p50"] for k, v in report.items() if k.startswith("batch_")}
    with tracking.resume_run(params.mlflow, Path("models/train/run.json")):
        import mlflow

        mlflow.log_metrics({**flat, "bench_end_to_end_img_s": report["end_to_end_img_s"]})
        mlflow.log_artifact(str(out / "metrics.json"), "benchmark")
    print(f"benchmark: end to end from files {report['end_to_end_img_s']:.1f} img/s")


if __name__ == "__main__":
    run_stage("benchmark", main)
