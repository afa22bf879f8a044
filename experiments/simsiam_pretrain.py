"""Self-supervised pretraining (SimSiam) on the prepared images, labels unused: a research prototype.

Measured on the magnetic tiles (README, *Measured on the magnetic tile photographs*): 10 epochs over all
1,344 images took 8.7 minutes here and the fine-tuned model was no better than one trained from
scratch, so the pipeline does not run it (that run drew its views with the same transforms written
by hand in torch; this script builds them with the project's albumentations policy builder). It is
kept to reproduce that row, and for a machine with a GPU, where hundreds of epochs are affordable:

    dvc repro augment                                   # data/prepared for your data.source
    python experiments/simsiam_pretrain.py --epochs 10 --out models/simsiam.pth
    dvc exp run -S model.pretrained=models/simsiam.pth  # fine-tune from it (any train params)

The file holds the backbone's weights without a classifier: the format ``model.pretrained`` loads.
SimSiam: Chen and He, "Exploring Simple Siamese Representation Learning", CVPR 2021.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.augment import apply_policy, build_policy
from pipeline.config import load_params
from pipeline.model import create_model
from pipeline.prepare import load_split
from pipeline.runtime import resolve_runtime


def view_policy(side: int) -> list[dict]:
    """The augmentation that makes the two views of an image, in ``augment.policy`` form: a random
    resized crop (30-100% of the area) to ``side`` px, flips, a 90-degree turn, gamma, blur and noise."""
    return [
        {"name": "RandomResizedCrop", "size": [side, side], "scale": [0.3, 1.0], "p": 1.0},
        {"name": "HorizontalFlip", "p": 0.5},
        {"name": "VerticalFlip", "p": 0.5},
        {"name": "RandomRotate90", "p": 1.0},
        {"name": "RandomGamma", "gamma_limit": [60, 160], "p": 0.8},
        {"name": "GaussianBlur", "blur_limit": [3, 5], "sigma_limit": [0.3, 1.5], "p": 0.4},
        {"name": "GaussNoise", "std_range": [0.01, 0.03], "p": 0.3},
    ]


def random_view(batch: torch.Tensor, policy) -> torch.Tensor:
    """One augmented view of each (N, S, S, C) uint8 image, as (N, side, side, C) float 0..255."""
    return torch.from_numpy(np.stack([apply_policy(policy, img) for img in batch.numpy()])).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepared", type=Path, default=Path("data/prepared"))
    ap.add_argument("--splits", default="train,val,test", help="which splits' images (labels are not read)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--view-size", type=int, default=96, help="side of the augmented views (cost ~ side^2)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=Path("models/simsiam.pth"))
    args = ap.parse_args()

    params = load_params(Path("params.yaml"))
    torch.manual_seed(params.train.seed)
    policy = build_policy(view_policy(args.view_size), seed=params.train.seed)
    images = torch.from_numpy(np.concatenate([load_split(args.prepared, s)[0] for s in args.splits.split(",")]))
    print(f"{len(images)} images from {args.splits}, {images.shape[1]} px, views of {args.view_size} px", flush=True)

    # The pipeline's own network (input normalization included), with its classifier removed.
    # The train stage's device and precision (train.device, train.precision): bf16 on CPUs that have it, a GPU where
    # there is one.
    rt = resolve_runtime(params.train.device, params.train.precision)
    net = create_model(params.model, num_classes=0, in_chans=images.shape[3])
    net = net.to(rt.device, memory_format=torch.channels_last)
    dim = net.backbone.num_features
    projector = nn.Sequential(
        nn.Linear(dim, 512, bias=False), nn.BatchNorm1d(512), nn.ReLU(inplace=True),
        nn.Linear(512, 512, bias=False), nn.BatchNorm1d(512), nn.ReLU(inplace=True),
        nn.Linear(512, 512, bias=False), nn.BatchNorm1d(512, affine=False),
    ).to(rt.device)  # fmt: skip
    predictor = nn.Sequential(nn.Linear(512, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
                              nn.Linear(128, 512)).to(rt.device)  # fmt: skip
    # The predictor keeps a constant learning rate (as in the paper); the rest decays on a cosine.
    opt = torch.optim.SGD(
        [{"params": [*net.parameters(), *projector.parameters()], "decay": True},
         {"params": predictor.parameters(), "decay": False}],
        lr=args.lr, momentum=0.9, weight_decay=5e-4,
    )  # fmt: skip
    steps = len(images) // args.batch_size
    if steps == 0:
        raise SystemExit(f"--batch-size {args.batch_size} is larger than the {len(images)} images")
    total, step, start = steps * args.epochs, 0, time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(images))
        losses, spread = [], []
        for i in range(steps):
            batch = images[order[i * args.batch_size : (i + 1) * args.batch_size]]
            v1, v2 = (random_view(batch, policy).to(rt.device) for _ in range(2))
            for group in opt.param_groups:
                group["lr"] = args.lr * (0.5 * (1 + math.cos(math.pi * step / total)) if group["decay"] else 1.0)
            with rt.autocast():
                z = projector(net(torch.cat([v1, v2])))
                p = predictor(z)
            z, p = z.float(), p.float()
            (z1, z2), (p1, p2) = z.chunk(2), p.chunk(2)
            loss = -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            losses.append(loss.item())
            # Spread of the normalized embeddings times sqrt(dim): about 1 when healthy, 0 when collapsed.
            spread.append(F.normalize(z1.detach(), dim=1).std(dim=0).mean().item() * math.sqrt(z1.shape[1]))
        print(
            f"epoch {epoch}/{args.epochs}: loss {np.mean(losses):.3f} (-1 is best), embedding spread "
            f"{np.mean(spread):.2f} (1 healthy, 0 collapsed), {time.time() - start:.0f} s",
            flush=True,
        )
        torch.save(net.backbone.state_dict(), args.out)
    print(f"wrote {args.out}: use it with model.pretrained: {args.out}")


if __name__ == "__main__":
    main()
