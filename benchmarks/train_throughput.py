"""Training throughput, measured side by side in one process (images per second, medians of rounds).

    python benchmarks/train_throughput.py --mode loop   # CPU: the stage's loop vs a plain reference loop
    python benchmarks/train_throughput.py --mode gpu    # GPU: fp32 vs AMP, +-channels_last, +-torch.compile

``loop`` answers "what does our machinery cost": the train stage's own loop (``train_one_epoch`` over
``EpochBatches`` and the augmenting ``ImageDataset``, with EMA, clipping and the NaN check) against
the textbook loop (shuffle, forward, loss, backward, step) on the same model, same images, same
batch size. ``gpu`` runs the stage's loop at 224 px on pre-staged batches in each configuration.
Contenders alternate round by round, so a noisy neighbour slows all of them alike; the JSON keeps every
round. This file imports only torch, timm, numpy and the torch-only pipeline modules (plus
albumentations in ``loop`` mode), so it runs on a GPU box with nothing installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import ModelConfig, load_params  # noqa: E402
from pipeline.distributed import Dist  # noqa: E402
from pipeline.model import create_model  # noqa: E402
from pipeline.runtime import resolve_runtime  # noqa: E402
from pipeline.training.loop import EMA, EpochProgress, train_one_epoch  # noqa: E402

PARAMS = load_params(Path(__file__).resolve().parents[1] / "params.yaml")  # the project's defaults
DEFAULT_MODEL = PARAMS.model.name


def make_model(name: str, device: torch.device, channels_last: bool, num_classes: int = 4) -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(name=name, pretrained="false", drop_rate=0.1, global_pool="avgmax", input_norm="per_image")
    model = create_model(cfg, num_classes, 3).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def random_images(n: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), rng.integers(0, 4, n).astype(np.int64)


class Contender:
    """A model, its optimizer and a ``run(steps)`` that trains that many steps and returns images seen."""

    def __init__(self, name: str, run: Callable[[int], int]) -> None:
        self.name, self.run, self.rounds = name, run, []

    def timed(self, steps: int, sync: Callable[[], None]) -> None:
        sync()
        t0 = time.perf_counter()
        images = self.run(steps)
        sync()
        self.rounds.append(images / (time.perf_counter() - t0))


def stage_loop(model: nn.Module, batches_fn, rt, grad_clip: float = 5.0, ema: float = 0.0) -> Callable[[int], int]:
    """The train stage's loop: ``train_one_epoch`` on ``steps`` batches from ``batches_fn(steps)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    crit, averager = nn.CrossEntropyLoss(), EMA(model, ema)

    def run(steps: int) -> int:
        progress = EpochProgress()
        out = train_one_epoch(
            model, batches_fn(steps), crit, opt, sched, rt, averager, progress, Dist("none"), grad_clip
        )
        run.data_wait_shares.append(out["data_wait_share"])
        return progress.seen

    run.data_wait_shares = []
    return run


def plain_loop(model: nn.Module, images: np.ndarray, labels: np.ndarray, batch_size: int) -> Callable[[int], int]:
    """The textbook loop: shuffled batches from a TensorDataset, forward, loss, backward, step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.02)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.from_numpy(images), torch.from_numpy(labels)),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
    )

    def run(steps: int) -> int:
        model.train()
        seen = 0
        for i, (x, y) in enumerate(loader):
            if i == steps:
                break
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(y)
        return seen

    return run


def loop_mode(args) -> dict:
    """CPU, fp32: the stage's loop (augmentation on) against the plain loop, same model and images."""
    from pipeline.data.augment import ImageDataset, build_policy
    from pipeline.training.loop import EpochBatches

    t = PARAMS.train
    size, bs = args.image_size or PARAMS.prepare.image_size, args.batch_size or t.batch_size
    rt = resolve_runtime("cpu", "fp32")
    images, labels = random_images(bs * args.steps * 2, size)
    policy = build_policy(PARAMS.augment.policy)
    dataset = ImageDataset(images, labels, policy)
    sampler = EpochBatches(labels, bs, seed=0)

    def stage_batches(steps: int, workers: int = 0):
        sampler.set_epoch(len(ours.rounds))
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=workers, generator=torch.Generator()
        )
        return _take(loader, steps)

    def loader_only(workers: int):
        def run(steps: int) -> int:
            return sum(len(y) for _, y in stage_batches(steps, workers))

        return run

    cl = t.channels_last
    ours = Contender(
        "stage loop (augment, clip, EMA if on, NaN check)",
        stage_loop(make_model(args.model, rt.device, cl), stage_batches, rt, t.grad_clip, t.ema),
    )
    plain = Contender("plain loop", plain_loop(make_model(args.model, rt.device, cl), images, labels, bs))
    loaders = [Contender(f"data loader alone, {w} workers", loader_only(w)) for w in (0, 2)]
    contenders = [ours, *loaders, plain]
    for c in contenders:  # warmup
        c.run(1)
    for _ in range(args.rounds):
        for c in contenders:
            c.timed(args.steps, lambda: None)
    setup = {
        "mode": "loop",
        "model": args.model,
        "image_size": size,
        "batch_size": bs,
        "device": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    result = report(contenders, setup)
    wait = statistics.median(ours.run.data_wait_shares[1:])  # the warm-up epoch excluded
    result["stage_loop_data_wait_share"] = round(wait, 4)
    print(f"share of the stage loop's step time spent waiting for data: {wait:.1%}")
    return result


class _take:
    """The first ``steps`` batches of a loader, as a sized iterable (what train_one_epoch expects)."""

    def __init__(self, loader, steps: int) -> None:
        self.loader, self.steps = loader, min(steps, len(loader))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == self.steps:
                return
            yield batch


def gpu_mode(args) -> dict:
    """CUDA: fp32 vs AMP (bf16 where supported, else fp16), with and without channels_last; AMP +
    channels_last also compiled."""
    if not torch.cuda.is_available():
        raise SystemExit("gpu mode needs a CUDA GPU; torch sees none (use --mode loop on a CPU)")
    # Batch 256: at 64 this network is bound by kernel launches on an H200 (2.9x fewer img/s measured).
    size, bs = args.image_size or 224, args.batch_size or 256
    images, labels = random_images(bs * 4, size)
    staged = [
        (torch.from_numpy(images[i * bs : (i + 1) * bs]).cuda(), torch.from_numpy(labels[i * bs : (i + 1) * bs]).cuda())
        for i in range(4)
    ]
    # Every precision x memory layout; torch.compile only on the last (AMP + channels_last), because
    # each compile of a training graph costs about a minute and the check has ten.
    variants = [(p, cl, False) for p in ("fp32", "auto") for cl in (False, True)]
    variants += [] if args.no_compile else [("auto", True, True)]
    contenders = []
    for precision, channels_last, compiled in variants:
        rt = resolve_runtime("cuda", precision)
        model = make_model(args.model, rt.device, channels_last)
        if compiled:
            model.compile()
        name = f"{rt.precision}{' +channels_last' if channels_last else ''}{' +compile' if compiled else ''}"
        contenders.append(Contender(name, stage_loop(model, lambda n: [staged[i % 4] for i in range(n)], rt)))
    for c in contenders:  # warmup (compiles here)
        c.run(3)
    for _ in range(args.rounds):
        for c in contenders:
            c.timed(args.steps, torch.cuda.synchronize)
    return report(
        contenders,
        {
            "mode": "gpu",
            "model": args.model,
            "image_size": size,
            "batch_size": bs,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
        },
    )


def report(contenders: list[Contender], setup: dict) -> dict:
    base = statistics.median(contenders[-1 if setup["mode"] == "loop" else 0].rounds)
    rows = []
    for c in contenders:
        med = statistics.median(c.rounds)
        rows.append(
            {
                "name": c.name,
                "img_s": round(med, 1),
                "ratio": round(med / base, 3),
                "rounds": [round(r, 1) for r in c.rounds],
            }
        )
    ref = "plain loop" if setup["mode"] == "loop" else rows[0]["name"]
    print(f"\n{setup}\n{'contender':<48} {'img/s':>8} {'x ' + ref:>14}   rounds")
    for r in rows:
        print(f"{r['name']:<48} {r['img_s']:>8.1f} {r['ratio']:>14.3f}   {r['rounds']}")
    return {"setup": setup, "date": time.strftime("%Y-%m-%d"), "results": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["loop", "gpu"], default="gpu" if torch.cuda.is_available() else "loop")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--image-size", type=int, default=0, help="default: params.yaml (loop), 224 (gpu)")
    ap.add_argument("--batch-size", type=int, default=0, help="default: params.yaml (loop), 256 (gpu)")
    ap.add_argument("--steps", type=int, default=8, help="steps per contender per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="gpu mode: skip the torch.compile contenders")
    ap.add_argument("--out", type=Path, default=Path("reports/bench/train_throughput.json"))
    args = ap.parse_args()
    result = loop_mode(args) if args.mode == "loop" else gpu_mode(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
