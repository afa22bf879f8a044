"""Stage export: fp32, fp16 and int8 ONNX (uint8 in, probabilities + defect score out), each scored on
the test set against PyTorch, gated, and described by its model card (``pipeline.export.build``)."""

from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.export.build import Inputs, export_model, summary_lines, write_reports
from pipeline.export.onnx import ParityError

OUT = Path("reports/export")


def main(params):
    e = export_model(params.export, params.mlflow.experiment, Inputs(), Path("models/export/model.onnx"))
    metrics = write_reports(e, OUT)
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="export") as run:
        run.log_metrics({f"export_{v}_{k}": val for v, m in metrics.items() for k, val in m.items()})
        run.set_tags({f"export.recommended.{p}": v for p, v in e.recommended.items()})
        run.log_artifacts("models/export", "export")
        run.log_artifacts(OUT, "export_report")
    print("\n".join(summary_lines(e)))
    if e.report["fp32"]["prob_max_abs_diff"] > params.export.max_abs_diff:
        raise ParityError(
            f"the fp32 export itself is broken: ONNX vs PyTorch max probability difference "
            f"{e.report['fp32']['prob_max_abs_diff']:.3g} exceeds export.max_abs_diff={params.export.max_abs_diff} "
            f"on {e.test_images} test images"
        )


if __name__ == "__main__":
    run_stage("export", main)
