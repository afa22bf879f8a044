"""GPU inference throughput of the default model at 224 px: PyTorch (fp32, fp16 + channels_last,
fp16 + torch.compile with CUDA graphs) and onnxruntime (CUDA and TensorRT providers, where this
machine's onnxruntime has them) at batch 1 and 256, side by side in one process.

    python3 benchmarks/gpu_inference.py --out reports/gpu/inference_gpu.json

Needs only torch, timm, numpy and (for the onnxruntime rows) onnxruntime-gpu: the GPU check script
runs it with the GPU machine's own python3. Anchor printed beside the figures: about 9,000 img/s for
EfficientNet-B0 inference at batch 1024 on an RTX 4090 (timm's published benchmark table); our default
tf_efficientnetv2_b0 has more FLOPs than B0 but plain (fused) convolutions in its early stages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.train_throughput import DEFAULT_MODEL, make_model  # noqa: E402
from pipeline.model import ExportHead  # noqa: E402

ANCHOR = "timm's table: ~9,000 img/s EfficientNet-B0 inference at batch 1024 on an RTX 4090 (AMP, channels_last)"


def timed(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def torch_contenders(model_name: str, size: int, batch: int) -> dict[str, Callable[[], object]]:
    x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device="cuda")
    out: dict[str, Callable[[], object]] = {}
    fp32 = make_model(model_name, torch.device("cuda"), channels_last=False).eval()
    # fp16 through autocast, as the pipeline runs it: the model's first op turns uint8 pixels into
    # fp32 (its normalisation), so weights cast with .half() would meet fp32 inputs.
    fp16 = make_model(model_name, torch.device("cuda"), channels_last=True).eval()

    def run(model, x_in, half: bool = False):
        def f():
            with torch.inference_mode(), torch.autocast("cuda", torch.float16, enabled=half):
                return model(x_in)

        return f

    out["torch fp32"] = run(fp32, x)
    out["torch fp16 +channels_last"] = run(fp16, x, half=True)
    try:  # "reduce-overhead" captures CUDA graphs: what batch 1 needs most
        compiled = torch.compile(fp16, mode="reduce-overhead")
        out["torch fp16 +channels_last +compile (CUDA graphs)"] = run(compiled, x, half=True)
    except Exception as exc:  # noqa: BLE001
        print(f"torch.compile unavailable: {exc}")
    return out


def onnx_contenders(model_name: str, size: int, batch: int, onnx_path: Path, trt_cache: Path) -> dict:
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed here: no onnxruntime rows")
        return {}
    available = ort.get_available_providers()
    x = np.random.default_rng(0).integers(0, 256, (batch, size, size, 3), dtype=np.uint8)
    out = {}
    wanted = {
        "onnxruntime CUDA fp32": ["CUDAExecutionProvider"],
        "onnxruntime TensorRT fp16": [
            (
                "TensorrtExecutionProvider",
                {"trt_fp16_enable": "1", "trt_engine_cache_enable": "1", "trt_engine_cache_path": str(trt_cache)},
            ),
            "CUDAExecutionProvider",
        ],
    }
    for name, providers in wanted.items():
        first = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
        if first not in available:
            print(f"{name}: {first} not in this onnxruntime ({available})")
            continue
        try:
            sess = ort.InferenceSession(str(onnx_path), providers=providers)
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: session failed: {exc}")
            continue
        if sess.get_providers()[0] != first:
            print(f"{name}: fell back to {sess.get_providers()}")
            continue
        out[name] = lambda s=sess: s.run(None, {"image": x})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("reports/gpu/inference_gpu.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_inference needs a CUDA GPU; torch sees none")
    try:
        import onnxruntime as ort

        providers = ort.get_available_providers()
    except ImportError:
        providers = []
    size = args.image_size
    print(f"{torch.cuda.get_device_name()}, {args.model} at {size} px; onnxruntime providers here: {providers}")
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "model.onnx"
        head = ExportHead(make_model(args.model, torch.device("cpu"), channels_last=False), ok_index=0).eval()
        torch.onnx.export(
            head,
            (torch.zeros(2, size, size, 3, dtype=torch.uint8),),
            str(onnx_path),
            input_names=["image"],
            output_names=["probs", "defect_score"],
            dynamic_axes={"image": {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )
        results = {}
        for bs in args.batches:
            contenders = torch_contenders(args.model, size, bs)
            contenders |= onnx_contenders(args.model, size, bs, onnx_path, Path(tmp) / "trt")
            calls = 50 if bs == 1 else 5
            for f in contenders.values():  # warm-up: compile, CUDA graph capture, TensorRT engine build
                for _ in range(3):
                    f()
            samples: dict[str, list[float]] = {k: [] for k in contenders}
            for _ in range(args.rounds):
                for k, f in contenders.items():
                    samples[k].append(timed(f, calls, torch.cuda.synchronize))
            results[f"batch_{bs}"] = rows = {
                k: {"ms": statistics.median(s) * 1000, "img_s": bs / statistics.median(s)} for k, s in samples.items()
            }
            for k, r in rows.items():
                print(f"batch_{bs:<4} {k:<52} {r['ms']:9.2f} ms {r['img_s']:10.0f} img/s", flush=True)
            write(args.out, results, providers, args.model, size)  # after each batch size: a timeout keeps it
            del contenders
            torch.cuda.empty_cache()
    print(f"anchor: {ANCHOR}")


def write(out: Path, results: dict, providers: list[str], model: str, size: int) -> None:
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "onnxruntime_providers": providers,
        "model": model,
        "image_size": size,
        "results": results,
        "anchor": ANCHOR,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
