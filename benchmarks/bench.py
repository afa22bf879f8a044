"""`make bench`: every performance claim of the project, measured side by side on this machine.

    python benchmarks/bench.py                      # all sections (~15-20 min on 2 cores)
    python benchmarks/bench.py --only inference serving --quick

Sections (each writes reports/bench/<section>.json; all together write reports/bench/README.md and
reports/bench/bench.png):
  inference  the runner (each exported variant) vs PyTorch eager vs torch.compile, same model and
             images: batch 1 p50/p99, throughput at batch 8 and 32; end to end from JPEG files
  sizes      end to end from JPEG per input size (96-224 px): where 116 img/s (10 M images a day) is reached
  serving    `defect-runner serve` at concurrency 1, 8 and 32 vs the runner in process, mean batch size
  data       loader images/s from image files: decode + the albumentations policy vs the equivalent
             torchvision transforms, per worker count
  training   the train stage's loop vs a minimal PyTorch loop (benchmarks/train_throughput.py)
  pipeline   `dvc repro` from scratch with the defaults in a fresh copy, and a no-op `dvc repro`

Every comparison is interleaved (contender A, B, C, A, B, C, ...) in one run and reported as medians
with the spread and as ratios, because absolute times on shared machines drift. Needs the pipeline's
outputs (`make run`) for the model and images.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.export import benchmark as driver  # noqa: E402
from pipeline.export.timing import as_jpeg, http_vs_in_process, photographs, timed_for  # noqa: E402
from serving.runner import Runner  # noqa: E402

# Where the pipeline's outputs are (the project by default; tests point it at a tiny copy).
PROJECT = ROOT
OUT = PROJECT / "reports/bench"
EXPORT = PROJECT / "models/export"
COMPILE = True
TARGETS = {
    "runner_vs_eager_b1": 2.0,  # the runner at least 2x PyTorch eager at batch 1 on CPU
    "http_c32_vs_in_process": 0.70,  # HTTP at concurrency 32 at least 70% of the in-process runner
    "train_loop_vs_reference": 0.90,  # the train loop within 10% of the minimal loop
    "end_to_end_img_s": 116.0,  # 10 million images a day
}


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {"cpu": cpu, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "python": platform.python_version()}


def test_images(limit: int) -> tuple[np.ndarray, list[Path]]:
    return driver.Inputs(PROJECT).test_images(limit)


# --- sections -------------------------------------------------------------------------------------


def inference(quick: bool) -> dict:
    """The benchmark stage's comparison (``pipeline.export.benchmark``) at batch 1, 8 and 32, with
    torch.compile beside it and more repeats; deployable variants only."""
    src = driver.Inputs(PROJECT)
    rs = driver.runners(src.export, only_deployable=True)
    x, files = src.test_images(64 if quick else 256)
    x, _ = driver.inputs_of(rs, x, files)
    fns, compile_note = driver.contenders(rs, src, compile_=COMPILE)
    print(f"inference: torch.compile {compile_note}")
    report: dict = {
        "compile": compile_note,
        "variants": list(rs),
        "photographs_with_tiles": rs["fp32"].card.tiles is not None,
    }
    report |= driver.compare(fns, x, [1, 8, 32], 10 if quick else 30, 3)
    report["end_to_end"] = driver.files_end_to_end(rs, files, 2 if quick else 3, 32)
    print("inference end to end: " + json.dumps(report["end_to_end"]))
    return report


def size_sweep(quick: bool) -> dict:
    """End to end from JPEG (decode, letterbox, fp32 inference at batch 32) per input size: where does
    this machine pass 116 img/s? The default architecture, exported with untrained weights at each size
    (the speed does not depend on the weights)."""
    import onnxruntime as ort
    import torch
    import yaml

    from benchmarks.train_throughput import make_model
    from pipeline.model import ExportHead
    from serving.preprocess import load_image

    params = yaml.safe_load((PROJECT / "params.yaml").read_text())
    _, files = test_images(64 if quick else 128)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        jpegs = as_jpeg(files, Path(tmp))
        head = ExportHead(make_model(params["model"]["name"], torch.device("cpu"), channels_last=False), 0).eval()
        for size in (96, 128, 160, 192, 224) if not quick else (96, 128):
            path = Path(tmp) / f"m{size}.onnx"
            torch.onnx.export(
                head,
                (torch.zeros(2, size, size, 3, dtype=torch.uint8),),
                str(path),
                input_names=["image"],
                output_names=["probs", "defect_score"],
                dynamic_axes={"image": {0: "batch"}},
                opset_version=17,
                dynamo=False,
            )
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            sess.run(None, {"image": np.zeros((32, size, size, 3), np.uint8)})

            def run(size=size, sess=sess) -> int:
                for i in range(0, len(jpegs), 32):
                    x = np.stack([load_image(f, size, 3, "letterbox") for f in jpegs[i : i + 32]])
                    sess.run(None, {"image": x})
                return len(jpegs)

            out[str(size)] = statistics.median(timed_for(run, 0.1) for _ in range(2 if quick else 3))
            print(f"size sweep: {size} px end to end from JPEG {out[str(size)]:.0f} img/s")
    return {"model": params["model"]["name"], "jpeg_img_s_by_size": out}


def serving(quick: bool) -> dict:
    x, files = test_images(64)
    fp32 = Runner(EXPORT / "model.onnx", providers="cpu", force=True)
    if fp32.card.tiles:  # tensors of photographs at full resolution, as the server takes them with tiles
        x = photographs(fp32, files)
    recommended = fp32.card.recommended.get("cpu", "fp32")
    model = EXPORT / ("model.onnx" if recommended == "fp32" else f"model.{recommended}.onnx")
    report = {"variant": recommended}
    for c in (1, 8, 32):
        r = http_vs_in_process(model, x, files, c, 2 if quick else 4, 2 if quick else 3)
        report[f"concurrency_{c}"] = r
        print(
            f"serving c={c}: tensors {r['infer_img_s']:.0f} img/s (p50 {r['infer_p50_ms']:.1f} ms, p99 "
            f"{r['infer_p99_ms']:.1f}) vs in process {r['in_process_img_s']:.0f} -> {r['infer_vs_in_process']:.2f}; "
            f"mean batch {r['mean_batch']:.1f}; images {r['classify_img_s']:.0f} vs {r['in_process_files_img_s']:.0f}"
        )
    return report


def data(quick: bool) -> dict:
    """From image files: our decode (serving.preprocess) + albumentations policy vs torchvision."""
    import torch
    import torchvision.transforms.v2 as T
    import yaml
    from torchvision.io import ImageReadMode, decode_image

    from pipeline.data.augment import build_policy
    from serving.preprocess import load_image

    params = yaml.safe_load((PROJECT / "params.yaml").read_text())
    size = params["prepare"]["image_size"]
    _, files = test_images(128 if quick else 256)
    policy = build_policy(params["augment"]["policy"])

    class Ours(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            img = load_image(files[i], size, 3, "letterbox")
            return torch.from_numpy(np.ascontiguousarray(policy(image=img)["image"]))

    rot90 = T.RandomApply([T.Lambda(lambda t: torch.rot90(t, int(torch.randint(1, 4, ())), (-2, -1)))], p=0.5)
    tv = T.Compose(
        [
            T.Resize((size, size), antialias=True),  # torchvision has no letterbox: a plain resize
            T.RandomHorizontalFlip(),
            T.RandomVerticalFlip(),
            rot90,
            T.RandomApply([T.ColorJitter(brightness=0.1, contrast=0.1)], p=0.3),
        ]
    )

    class Torchvision(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            return tv(decode_image(str(files[i]), mode=ImageReadMode.RGB))

    def loader_fn(ds, workers):
        # One loader per contender, workers kept alive between passes (as across training epochs), so
        # the figure is the steady-state rate, not process start-up.
        loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=workers, persistent_workers=workers > 0)

        def run() -> int:
            return sum(len(b) for b in loader)

        run()  # warm-up pass: starts the workers
        return run

    report = {}
    for w in (0, 1, 2):
        ours_fn, theirs_fn = loader_fn(Ours(), w), loader_fn(Torchvision(), w)
        ours, theirs = [], []
        for _ in range(2 if quick else 3):
            ours.append(timed_for(ours_fn, 0.1))  # at least one full pass per sample
            theirs.append(timed_for(theirs_fn, 0.1))
        del ours_fn, theirs_fn  # stops the workers
        report[f"workers_{w}"] = {
            "ours_img_s": statistics.median(ours),
            "torchvision_img_s": statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs),
            "ours_rounds": ours,
            "torchvision_rounds": theirs,
        }
        r = report[f"workers_{w}"]
        print(
            f"data workers={w}: ours {r['ours_img_s']:.0f} img/s vs torchvision {r['torchvision_img_s']:.0f} "
            f"({r['ratio']:.2f})"
        )
    return report


def training(quick: bool) -> dict:
    out = OUT / "train_throughput.json"
    steps, rounds = ("4", "3") if quick else ("8", "5")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks/train_throughput.py"),
            "--mode",
            "loop",
            "--steps",
            steps,
            "--rounds",
            rounds,
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
    )
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["results"]}
    stage = next(r for n, r in rows.items() if n.startswith("stage loop"))
    result["stage_vs_plain"] = stage["ratio"]
    return result


def pipeline(quick: bool) -> dict:
    """`dvc repro` from scratch in a fresh copy of the project (own DVC cache and MLflow store)."""
    from tests.conftest import copy_project

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    with tempfile.TemporaryDirectory() as tmp:
        work = copy_project(Path(tmp))
        for d in ("data", "models", "reports", "mlflow.db", "dvc.lock"):
            shutil.rmtree(work / d, ignore_errors=True) if (work / d).is_dir() else (work / d).unlink(missing_ok=True)
        cmd = ["dvc", "repro"]
        if quick:  # a smaller run that still goes through every stage
            cmd = ["dvc", "exp", "run", "--temp", "-S", "train.epochs=2"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
        scratch = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(["dvc", "repro"], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
        noop = time.perf_counter() - t0
    print(f"pipeline: dvc repro from scratch {scratch:.0f} s, no-op {noop:.1f} s")
    return {"from_scratch_s": scratch, "noop_s": noop, "quick": quick}


SECTIONS = {
    "inference": inference,
    "sizes": size_sweep,
    "serving": serving,
    "data": data,
    "training": training,
    "pipeline": pipeline,
}


# --- the report -----------------------------------------------------------------------------------


def load(name: str) -> dict | None:
    p = OUT / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def markdown() -> str:
    m = load("machine") or machine()
    lines = [f"# Benchmarks: {m['cpu']}, {m['cores']} cores, {m['date']}", ""]
    checks: list[tuple[str, float, float]] = []
    for section in (inference_table, sizes_table, serving_table, other_tables):
        lines += section(checks)
    if checks:
        lines += ["## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        for name, got, goal in checks:
            lines.append(f"| {name} | {got:.2f} | {goal} | {'yes' if got >= goal else 'no'} |")
    return "\n".join(lines) + "\n"


def inference_table(checks: list) -> list[str]:
    lines: list[str] = []
    inf = load("inference")
    if inf:
        lines += ["## Inference (CPU provider; ratios vs PyTorch eager, same images, interleaved)", ""]
        lines += ["| contender | batch 1 p50 / p99 ms | x eager | batch 8 img/s | x eager | batch 32 img/s | x eager |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for k in inf["batch_1"]:
            b1, b8, b32 = inf["batch_1"][k], inf["batch_8"][k], inf["batch_32"][k]
            lines.append(
                f"| {k} | {b1['p50_ms']:.1f} / {b1['p99_ms']:.1f} | {b1['vs_eager']:.2f} | {b8['img_s']:.0f} | "
                f"{b8['vs_eager']:.2f} | {b32['img_s']:.0f} | {b32['vs_eager']:.2f} |"
            )
        lines += [
            "",
            f"torch.compile: {inf['compile']}",
            "",
            "End to end from files (decode, resize, infer at batch 32):",
            "",
        ]
        lines += ["| variant | JPEG img/s | PNG img/s |", "|---|---|---|"]
        for v, r in inf["end_to_end"].items():
            lines.append(f"| {v} | {r['jpeg_img_s']:.0f} | {r['png_img_s']:.0f} |")
        best = max(r["jpeg_img_s"] for r in inf["end_to_end"].values())
        checks.append(
            (
                "runner >= 2x eager at batch 1",
                max(inf["batch_1"][f"runner {v}"]["vs_eager"] for v in inf["variants"]),
                TARGETS["runner_vs_eager_b1"],
            )
        )
        checks.append(("end to end from JPEG, img/s (116 = 10 M/day)", best, TARGETS["end_to_end_img_s"]))
        lines.append("")
    return lines


def sizes_table(checks: list) -> list[str]:
    lines: list[str] = []
    sweep = load("sizes")
    if sweep:
        by = sweep["jpeg_img_s_by_size"]
        lines += [f"## End to end from JPEG by input size ({sweep['model']}, fp32, batch 32)", ""]
        lines += ["| input size | img/s | 116 img/s (10 M/day) |", "|---|---|---|"]
        lines += [f"| {k} px | {v:.0f} | {'reached' if v >= 116 else f'{v / 116:.0%} of it'} |" for k, v in by.items()]
        lines.append("")
    return lines


def serving_table(checks: list) -> list[str]:
    lines: list[str] = []
    srv = load("serving")
    if srv:
        lines += [
            f"## Serving (`defect-runner serve`, {srv['variant']}, closed-loop clients, binary tensors of one image)",
            "",
        ]
        lines += [
            "| concurrency | HTTP img/s | p50 / p99 ms | in process img/s (batch 16) | ratio | mean batch | images endpoint img/s | in process from files | ratio |"  # noqa: E501
        ]
        lines += ["|---|---|---|---|---|---|---|---|---|"]
        for c in (1, 8, 32):
            r = srv.get(f"concurrency_{c}")
            if r:
                lines.append(
                    f"| {c} | {r['infer_img_s']:.0f} | {r['infer_p50_ms']:.1f} / {r['infer_p99_ms']:.1f} | "
                    f"{r['in_process_img_s']:.0f} | {r['infer_vs_in_process']:.2f} | {r['mean_batch']:.1f} | "
                    f"{r['classify_img_s']:.0f} | {r['in_process_files_img_s']:.0f} | {r['classify_vs_in_process']:.2f} |"  # noqa: E501
                )
        if "concurrency_32" in srv:
            checks.append(
                (
                    "HTTP at concurrency 32 vs in process",
                    srv["concurrency_32"]["infer_vs_in_process"],
                    TARGETS["http_c32_vs_in_process"],
                )
            )
        lines.append("")
    return lines


def other_tables(checks: list) -> list[str]:
    """Data loading, the training loop and the pipeline's own timings."""
    lines: list[str] = []
    dat = load("data")
    if dat:
        lines += ["## Data loading from image files (decode + augmentation policy, batch 32)", ""]
        lines += [
            "| workers | ours (Pillow decode + letterbox + albumentations) img/s | torchvision (decode_image + v2) img/s | ratio |",  # noqa: E501
            "|---|---|---|---|",
        ]
        for w in (0, 1, 2):
            r = dat[f"workers_{w}"]
            lines.append(f"| {w} | {r['ours_img_s']:.0f} | {r['torchvision_img_s']:.0f} | {r['ratio']:.2f} |")
        lines.append("")
    tr = load("training")
    if tr:
        model = tr["setup"].get("model", "the default model")
        lines += [f"## Training loop ({model}, batch 32, fp32; ratio vs the plain loop)", ""]
        lines += ["| contender | img/s | ratio | rounds |", "|---|---|---|---|"]
        for r in tr["results"]:
            lines.append(f"| {r['name']} | {r['img_s']} | {r['ratio']} | {r['rounds']} |")
        checks.append(("train loop vs minimal loop", tr["stage_vs_plain"], TARGETS["train_loop_vs_reference"]))
        lines.append("")
    pipe = load("pipeline")
    if pipe:
        kind = "`dvc exp run -S train.epochs=2` (quick)" if pipe["quick"] else "`dvc repro` with the defaults"
        lines += [
            "## Pipeline",
            "",
            f"- from scratch, {kind}: {pipe['from_scratch_s']:.0f} s",
            f"- no-op `dvc repro`: {pipe['noop_s']:.1f} s",
            "",
        ]
    return lines


def plot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inf, srv = load("inference"), load("serving")
    if not inf:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = list(inf["batch_1"])
    for i, bs in enumerate((1, 8, 32)):
        axes[0].bar(
            np.arange(len(names)) + i * 0.27, [inf[f"batch_{bs}"][n]["img_s"] for n in names], 0.27, label=f"batch {bs}"
        )
    axes[0].set_xticks(np.arange(len(names)) + 0.27, names, rotation=20)
    axes[0].set(title="inference img/s (CPU)", ylabel="img/s")
    axes[0].legend()
    if srv:
        cs = [c for c in (1, 8, 32) if f"concurrency_{c}" in srv]
        axes[1].plot(cs, [srv[f"concurrency_{c}"]["infer_img_s"] for c in cs], "o-", label="HTTP, tensors")
        axes[1].plot(cs, [srv[f"concurrency_{c}"]["in_process_img_s"] for c in cs], "s--", label="in process, batch 16")
        axes[1].plot(cs, [srv[f"concurrency_{c}"]["classify_img_s"] for c in cs], "o-", label="HTTP, images")
        axes[1].axhline(116, color="red", linestyle=":", label="116 img/s = 10 M/day")
        axes[1].set(title="serving throughput", xlabel="concurrent clients", ylabel="img/s", xscale="log")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(OUT / "bench.png", dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run these sections (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions; 2-epoch pipeline run")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out of the inference section")
    ap.add_argument("--project", type=Path, default=ROOT, help="folder with the pipeline's outputs (default: here)")
    args = ap.parse_args()
    global PROJECT, OUT, EXPORT, COMPILE
    PROJECT, COMPILE = args.project.resolve(), not args.no_compile
    OUT, EXPORT = PROJECT / "reports/bench", PROJECT / "models/export"
    if not (EXPORT / "model.onnx").exists():
        sys.exit("bench: models/export/model.onnx not found: run `make run` (dvc repro) first")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "machine.json").write_text(json.dumps(machine(), indent=2) + "\n")
    for name in args.only or list(SECTIONS):
        t0 = time.perf_counter()
        result = SECTIONS[name](args.quick)
        result["seconds"] = round(time.perf_counter() - t0, 1)
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    (OUT / "README.md").write_text(markdown())
    plot()
    print(markdown())


if __name__ == "__main__":
    main()
