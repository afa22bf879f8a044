"""Self-supervised pretraining (SimSiam) on the prepared images, labels unused: a research prototype.

Measured on the magnetic tiles (README, *Measured on the magnetic tile photographs*): 10 epochs over all
1,344 images took 8.7 minutes here and the fine-tuned model was no better than one trained from
scratch, so the pipeline does not run it. It is kept to reproduce that row, and for a machine with a
GPU, where hundreds of epochs are affordable:

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

from pipeline.config import load_params
from pipeline.model import create_model
from pipeline.prepare import load_split


def random_view(batch: torch.Tensor, side: int, rng: np.random.Generator) -> torch.Tensor:
    """One augmented view of each (N, S, S, C) uint8 image, as (N, side, side, C) float 0..255: a random
    resized crop (30-100% of the area), flips, a 90-degree turn, gamma, blur and noise."""
    size = batch.shape[1]
    views = []
    for img in batch.permute(0, 3, 1, 2).float():
        scale, ratio = math.sqrt(rng.uniform(0.3, 1.0)), math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        h = max(16, min(size, int(size * scale / math.sqrt(ratio))))
        w = max(16, min(size, int(size * scale * math.sqrt(ratio))))
        y, x = rng.integers(0, size - h + 1), rng.integers(0, size - w + 1)
        v = F.interpolate(img[None, :, y : y + h, x : x + w], size=(side, side), mode="bilinear")[0]
        if rng.random() < 0.5:
            v = v.flip(2)
        if rng.random() < 0.5:
            v = v.flip(1)
        v = torch.rot90(v, int(rng.integers(4)), dims=(1, 2))
        if rng.random() < 0.8:
            v = 255.0 * (v / 255.0).clamp(0, 1) ** rng.uniform(0.6, 1.6)
        if rng.random() < 0.4:
            sigma, k = rng.uniform(0.3, 1.5), 5
            g = torch.exp(-((torch.arange(k) - k // 2) ** 2) / (2 * sigma**2)).float()
            c = v.shape[0]
            g = (g / g.sum()).repeat(c, 1, 1, 1)  # separable Gaussian, one filter per channel
            v = F.conv2d(v[None], g.view(c, 1, 1, k), padding=(0, k // 2), groups=c)
            v = F.conv2d(v, g.view(c, 1, k, 1), padding=(k // 2, 0), groups=c)[0]
        if rng.random() < 0.3:
            v = v + torch.randn_like(v) * rng.uniform(2, 8)
        views.append(v)
    return torch.stack(views).permute(0, 2, 3, 1).contiguous()


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
    rng = np.random.default_rng(params.train.seed)
    images = torch.from_numpy(np.concatenate([load_split(args.prepared, s)[0] for s in args.splits.split(",")]))
    print(f"{len(images)} images from {args.splits}, {images.shape[1]} px, views of {args.view_size} px", flush=True)

    # The pipeline's own network (input normalization included), with its classifier removed.
    net = create_model(params.model, num_classes=0, in_chans=images.shape[3]).to(memory_format=torch.channels_last)
    dim = net.backbone.num_features
    projector = nn.Sequential(
        nn.Linear(dim, 512, bias=False), nn.BatchNorm1d(512), nn.ReLU(inplace=True),
        nn.Linear(512, 512, bias=False), nn.BatchNorm1d(512), nn.ReLU(inplace=True),
        nn.Linear(512, 512, bias=False), nn.BatchNorm1d(512, affine=False),
    )  # fmt: skip
    predictor = nn.Sequential(nn.Linear(512, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
                              nn.Linear(128, 512))  # fmt: skip
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
            v1, v2 = random_view(batch, args.view_size, rng), random_view(batch, args.view_size, rng)
            for group in opt.param_groups:
                group["lr"] = args.lr * (0.5 * (1 + math.cos(math.pi * step / total)) if group["decay"] else 1.0)
            z = projector(net(torch.cat([v1, v2])))
            p = predictor(z)
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
