"""Stage evaluate: test metrics, the val-chosen threshold, plots and Grad-CAM heatmaps, logged to the
model's MLflow run."""

import json
from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.evaluation.evaluate import log_to_mlflow
from pipeline.evaluation.report import Inputs, evaluate_model

OUT = Path("reports/evaluate")


def main(params):
    metrics = evaluate_model(params.evaluate, params.train.device, Inputs(), OUT)
    (OUT / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="evaluate") as run:
        log_to_mlflow(run, metrics, OUT)
    print(f"evaluate: {metrics}")


if __name__ == "__main__":
    run_stage("evaluate", main)
