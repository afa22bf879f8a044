"""Stage train: packed images -> models/train/model.pt (+ checkpoints, MLflow run, curves, recipe.json).

With ``train.distributed`` ddp or fsdp this same command starts itself again under torchrun with
``train.processes`` processes; under a launcher already (a cluster job), it just trains.
"""

import sys
from pathlib import Path

from pipeline import distributed
from pipeline.entry import run_stage
from pipeline.training.recipe import train


def main(params):
    cfg = params.train
    if cfg.distributed != "none" and not distributed.under_launcher():
        rc = distributed.relaunch(__file__, cfg.processes)
        if rc != 0:
            print(f"\ntrain: error: a training process failed (exit {rc}); see its message above", file=sys.stderr)
            sys.exit(rc)
        return
    summary = train(params, Path("data/prepared"), Path("models/train"), Path("reports/train"), Path("reports"))
    if summary is not None:  # rank 0
        print(f"train: {summary}")


if __name__ == "__main__":
    run_stage("train", main)
