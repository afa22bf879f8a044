"""Stage benchmark: the edge runner (each exported variant) vs PyTorch eager on the same model and test
images, interleaved; end to end from PNG and JPEG files; the HTTP server vs the runner in process. With a
tile model both sides score the test photographs at full resolution (whole view and tiles, fused)."""

import json
import tempfile
from pathlib import Path

import torch

from pipeline import tracking
from pipeline.bench import (
    as_jpeg,
    batches,
    end_to_end,
    http_vs_in_process,
    interleaved,
    photographs,
    torch_scorer,
    variant_files,
)
from pipeline.entry import run_stage
from pipeline.prepare import load_split
from pipeline.train import load_model, load_tile_model
from serving.runner import Runner

EXPORT = Path("models/export")


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    b1 = report["batch_1"]
    names = [k for k in b1 if isinstance(b1[k], dict) and "p50_ms" in b1[k]]
    spread = [[0] * len(names), [b1[n]["p99_ms"] - b1[n]["p50_ms"] for n in names]]
    axes[0].bar(names, [b1[n]["p50_ms"] for n in names], yerr=spread)
    axes[0].set(title="batch 1 latency (p50, bar to p99)", ylabel="ms")
    e2e = report["end_to_end"]
    labels = [f"{v} {fmt.split('_')[0]}" for v in e2e for fmt in e2e[v]]
    values = [e2e[v][fmt] for v in e2e for fmt in e2e[v]]
    http = report["http"]
    labels += [f"HTTP c={http['concurrency']} tensors", f"HTTP c={http['concurrency']} images"]
    values += [http["infer_img_s"], http["classify_img_s"]]
    axes[1].barh(labels, values)
    axes[1].axvline(116, color="red", linestyle="--", label="116 img/s = 10 M images/day")
    axes[1].set(title="images/s end to end (decode, resize, infer)", xlabel="img/s")
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(params):
    cfg = params.benchmark
    x_test, _, paths = load_split(Path("data/prepared"), "test")
    x_test, paths = x_test[: cfg.max_images], paths[: cfg.max_images]
    files = [Path("data/raw/images") / p for p in paths]
    # spin=False: a busy-waiting onnxruntime thread pool would starve PyTorch in the interleaved rounds.
    runners = {v: Runner(f, providers="cpu", spin=False, force=True) for v, f in variant_files(EXPORT).items()}
    net, _ = load_model(Path("models/train/model.pt"))
    card = runners["fp32"].card
    x, inputs = x_test, f"prepared test images, {x_test.shape[1]} px"
    if card.tiles:  # the runner takes photographs at full resolution: both sides get them, both fuse two views
        x = photographs(runners["fp32"], files)
        inputs = (
            f"photographs with tiles: {len(x)} test photographs of {x.shape[2]}x{x.shape[1]} px (the most common "
            f"size), the whole view and {card.tiles.size} px tiles fused, in the runner and in PyTorch eager"
        )
    tile_net = load_tile_model(Path("models/train/model.pt"))[0] if card.tiles else None
    print(f"benchmark: inputs: {inputs}")

    eager = torch_scorer(net, tile_net, card)

    report: dict = {
        "inputs": inputs,
        "providers": runners["fp32"].providers,
        "torch_threads": torch.get_num_threads(),
        "deployable": {v: r.card.deployable for v, r in runners.items()},
        "input_size": runners["fp32"].card.input.size,
    }
    for bs in cfg.batch_sizes:
        batch = batches(x, bs)
        contenders = {v: (lambda r=r, b=batch: r.predict(b)) for v, r in runners.items()}
        res = interleaved(contenders | {"torch_eager": lambda b=batch: eager(b)}, bs, cfg.repeats, cfg.warmup)
        res["speedup_p50"] = {v: res["torch_eager"]["p50_ms"] / res[v]["p50_ms"] for v in runners}
        report[f"batch_{bs}"] = res
        print(
            f"benchmark: batch {bs}: torch eager {res['torch_eager']['p50_ms']:.1f} ms p50; "
            + ", ".join(f"{v} {res[v]['p50_ms']:.1f} ms ({res['speedup_p50'][v]:.2f}x)" for v in runners)
        )
    with tempfile.TemporaryDirectory() as tmp:  # the same images as JPEG, as most line cameras send them
        jpegs = as_jpeg(files, Path(tmp))
        report["end_to_end"] = end_to_end(runners, {"png": files, "jpeg": jpegs}, cfg.rounds, max(cfg.batch_sizes))
    for v, r in report["end_to_end"].items():
        print(f"benchmark: end to end {v}: " + ", ".join(f"{k} {x:.0f}" for k, x in r.items()))
    recommended = runners["fp32"].card.recommended.get("cpu", "fp32")
    http_model = variant_files(EXPORT).get(recommended, EXPORT / "model.onnx")
    report["http"] = http_vs_in_process(http_model, x[:64], files[:64], cfg.http_concurrency, cfg.http_seconds,
                                        cfg.rounds)  # fmt: skip
    h = report["http"]
    print(
        f"benchmark: HTTP ({h['variant']}, {h['concurrency']} clients): tensors {h['infer_img_s']:.0f} img/s vs "
        f"{h['in_process_img_s']:.0f} in process ({h['infer_vs_in_process']:.2f}), mean batch {h['mean_batch']:.1f}; "
        f"images {h['classify_img_s']:.0f} vs {h['in_process_files_img_s']:.0f} ({h['classify_vs_in_process']:.2f})"
    )
    out = Path("reports/benchmark")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "benchmark.png")
    flat = {}
    for bs in cfg.batch_sizes:
        for c, r in report[f"batch_{bs}"].items():
            if c == "speedup_p50":
                flat |= {f"bench_b{bs}_speedup_{v}": x for v, x in r.items()}
            else:
                flat |= {f"bench_b{bs}_{c}_p50_ms": r["p50_ms"], f"bench_b{bs}_{c}_img_s": r["img_s"]}
    flat |= {f"bench_e2e_{v}_{k}": x for v, r in report["end_to_end"].items() for k, x in r.items()}
    flat |= {f"bench_http_{k}": x for k, x in h.items() if isinstance(x, int | float)}
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="benchmark") as run:
        run.log_metrics(flat)
        run.log_artifacts(out / "metrics.json", "benchmark")
        run.log_artifacts(out / "benchmark.png", "benchmark")


if __name__ == "__main__":
    run_stage("benchmark", main)
