"""Stage train: packed images -> models/train/model.pt (+ checkpoints, MLflow run, curves)."""

from pathlib import Path

from pipeline.entry import run_stage
from pipeline.train import train


def main(params):
    summary = train(params, Path("data/prepared"), Path("models/train"), Path("reports/train"))
    print(f"train: {summary}")


if __name__ == "__main__":
    run_stage("train", main)
