"""Stage evaluate: test metrics, the val-chosen threshold, plots and Grad-CAM heatmaps, logged to the
model's MLflow run."""

import json
from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.evaluate import evaluate, log_to_mlflow, review_sheet
from pipeline.heatmaps import heatmap_report
from pipeline.metrics import softmax
from pipeline.prepare import load_groups, load_split
from pipeline.runtime import resolve_runtime
from pipeline.train import load_model, predict_logits


def main(params):
    net, meta = load_model(Path("models/train/model.pt"))
    # Full precision, whatever training used: the threshold chosen here goes on the card of the fp32
    # export, and bf16 scores differ from it by ~1e-2 (enough to move images across the threshold).
    rt = resolve_runtime(params.train.device, "fp32")
    net = net.to(rt.device)
    x_val, y_val, val_paths = load_split(Path("data/prepared"), "val")
    x_test, y_test, test_paths = load_split(Path("data/prepared"), "test")
    val_probs, test_probs = (softmax(predict_logits(net, x, rt)) for x in (x_val, x_test))
    out = Path("reports/evaluate")
    val_groups = load_groups(Path("data/prepared"), "val")
    metrics = evaluate(
        val_probs,
        y_val,
        test_probs,
        y_test,
        meta["classes"],
        meta["ok_class"],
        params.evaluate.target_defect_recall,
        out,
        params.evaluate.max_false_alarm_rate,
        val_groups,
        load_groups(Path("data/prepared"), "test"),
    )
    ok = meta["classes"].index(meta["ok_class"])
    metrics |= review_sheet(
        (x_val, y_val, val_paths, 1 - val_probs[:, ok]),
        (x_test, y_test, test_paths, 1 - test_probs[:, ok]),
        meta["classes"],
        meta["ok_class"],
        metrics["far_threshold"],
        out,
        val_groups,
    )
    if params.evaluate.heatmaps_per_class > 0:
        metrics |= heatmap_report(
            net.float().cpu(),
            x_test,
            y_test,
            test_probs,
            test_paths,
            meta["classes"],
            meta["ok_class"],
            Path("data/raw/masks"),
            meta["resize"],
            params.evaluate.heatmaps_per_class,
            out,
        )
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="evaluate") as run:
        log_to_mlflow(run, metrics, out)
    print(f"evaluate: {metrics}")


if __name__ == "__main__":
    run_stage("evaluate", main)
