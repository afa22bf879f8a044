"""Stage augment: build the albumentations policy from params, save it, draw a preview grid, and (with
``augment.balance``) write augmented copies of rare classes for the training split."""

from pathlib import Path

import numpy as np

from pipeline.augment import balance_copies, build_policy, preview, save_policy
from pipeline.entry import run_stage
from pipeline.prepare import load_split


def main(params):
    out = Path("reports/augment")
    out.mkdir(parents=True, exist_ok=True)
    policy = build_policy(params.augment.policy, seed=params.data.seed)
    save_policy(policy, out / "policy.json")
    preview(policy, Path("data/prepared"), params.augment.preview_per_class, out / "preview.png")

    images, labels, paths = load_split(Path("data/prepared"), "train")
    x, y, src = balance_copies(images, labels, policy, params.augment.balance, params.data.seed)
    Path("data/augmented").mkdir(parents=True, exist_ok=True)
    copies = np.array([f"{paths[i]}#copy{k}" for k, i in enumerate(src)], dtype=str)
    np.savez(Path("data/augmented/extra.npz"), images=x, labels=y, paths=copies)
    print(f"augment: policy of {len(params.augment.policy)} transforms; {len(y)} balancing copies added to train")


if __name__ == "__main__":
    run_stage("augment", main)
