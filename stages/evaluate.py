"""Stage evaluate: test metrics, the val-chosen threshold, plots and Grad-CAM heatmaps, logged to the
model's MLflow run."""

import json
from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.evaluation.evaluate import log_to_mlflow
from pipeline.evaluation.report import Inputs, evaluate_model

OUT = Path("reports/evaluate")
# What `dvc metrics show` and `dvc exp show` list (at the card's threshold); a 120-column terminal holds them.
# Defect-type sorting (no OK class, no threshold): accuracy and the worst class's recall.
HEADLINE = ("accuracy", "defect_recall", "false_alarm_rate")
SORTING_HEADLINE = ("accuracy", "min_class_recall")


def main(params):
    metrics = evaluate_model(params.evaluate, params.train.device, Inputs(), OUT)
    (OUT / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    keys = SORTING_HEADLINE if metrics["threshold"] is None else HEADLINE
    headline = {k: round(metrics[k], 4) for k in keys}  # what `dvc metrics show` lists
    (OUT / "headline.json").write_text(json.dumps(headline, indent=2) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="evaluate") as run:
        log_to_mlflow(run, metrics, OUT)
    said = ", ".join(f"{k} {v}" for k, v in headline.items())
    if metrics["threshold"] is None:
        print(f"evaluate: defect-type sorting: {said} (every figure: {OUT}/metrics.json)")
        return
    point = metrics["operating_point"]
    print(
        f"evaluate: {said} at the card's threshold {metrics['threshold']:.3f}, {point['status']} "
        f"(every figure: {OUT}/metrics.json)"
    )
    for warning in point["warnings"]:
        print(f"evaluate: warning: {warning}")


if __name__ == "__main__":
    run_stage("evaluate", main)
