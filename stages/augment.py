"""Stage augment: build the albumentations policy from params, save it, draw a preview grid."""

from pathlib import Path

from pipeline.augment import build_policy, preview, save_policy
from pipeline.entry import run_stage


def main(params):
    out = Path("reports/augment")
    out.mkdir(parents=True, exist_ok=True)
    policy = build_policy(params.augment.policy, seed=params.data.seed)
    save_policy(policy, out / "policy.json")
    preview(policy, Path("data/prepared"), params.augment.preview_per_class, out / "preview.png")


if __name__ == "__main__":
    run_stage("augment", main)
