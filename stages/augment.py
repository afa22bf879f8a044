"""Stage augment: build the albumentations policy from params (its flips and turns kept or dropped as
``augment.orientation`` decides on the training images), save it and the decision, draw a preview grid,
and (with ``augment.balance``) write augmented copies of rare classes for the training split."""

import json
from pathlib import Path

import numpy as np

from pipeline.data.augment import balance_copies, build_policy, preview, resolve_policy, save_policy
from pipeline.data.prepare import load_split
from pipeline.entry import run_stage


def main(params):
    out = Path("reports/augment")
    out.mkdir(parents=True, exist_ok=True)
    images, labels, paths = load_split(Path("data/prepared"), "train")
    spec, pose = resolve_policy(params.augment.policy, params.augment.orientation, images)
    (out / "orientation.json").write_text(json.dumps(pose, indent=2) + "\n")
    print(
        f"augment: orientation {pose['orientation']}: the training images' pose is {pose['pose']} (largest effect "
        f"{max(pose['effects'].values(), default=0):.2f}, threshold {pose['threshold']}); flips and turns "
        f"{pose['flips_and_turns']}" + (f" ({', '.join(pose['dropped'])})" if pose["dropped"] else "")
    )
    policy = build_policy(spec, seed=params.data.seed)
    save_policy(policy, out / "policy.json")
    preview(policy, Path("data/prepared"), params.augment.preview_per_class, out / "preview.png")

    x, y, src = balance_copies(images, labels, policy, params.augment.balance, params.data.seed)
    Path("data/augmented").mkdir(parents=True, exist_ok=True)
    copies = np.array([f"{paths[i]}#copy{k}" for k, i in enumerate(src)], dtype=str)
    np.savez(Path("data/augmented/extra.npz"), images=x, labels=y, paths=copies)
    print(f"augment: policy of {len(spec)} transforms; {len(y)} balancing copies added to train")


if __name__ == "__main__":
    run_stage("augment", main)
