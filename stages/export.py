"""Stage export: ONNX (uint8 in, probabilities + defect score out) with its model card and parity check."""

import json
from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.evaluate import softmax
from pipeline.export import ParityError, export_onnx, finish_card, parity
from pipeline.prepare import load_split
from pipeline.runtime import resolve_runtime
from pipeline.train import load_model, predict_logits
from serving.card import InputSpec, ModelCard
from serving.runner import Runner


def main(params):
    net, meta = load_model(Path("models/train/model.pt"))
    run_id = tracking.read_run_id(Path("models/train/run.json"))
    threshold = json.loads(Path("reports/evaluate/metrics.json").read_text())["threshold"]
    card = ModelCard(
        name=params.mlflow.experiment,
        architecture=meta["architecture"],
        classes=meta["classes"],
        ok_class=meta["ok_class"],
        input=InputSpec(meta["image_size"], meta["channels"], meta["resize"]),
        threshold=threshold,
        training_run_id=run_id,
        data_fingerprint=meta["fingerprint"],
    )
    path = Path("models/export/model.onnx")
    export_onnx(net, card.ok_index, meta["image_size"], meta["channels"], params.export.opset, path, card)

    # Parity on the real test images: PyTorch vs the edge runner running the exported file.
    x_test, _, _ = load_split(Path("data/prepared"), "test")
    torch_probs = softmax(predict_logits(net, x_test, resolve_runtime("cpu", "fp32")))
    card = finish_card(card, path, {})
    runner = Runner(path, providers="cpu")
    onnx_probs = runner.predict(x_test)[0]
    report = {
        **parity(torch_probs, onnx_probs, threshold, card.ok_index),
        "limit": params.export.max_abs_diff,
        "model_bytes": path.stat().st_size,
    }
    finish_card(card, path, report)
    out = Path("reports/export")
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(report, indent=2) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json")):
        import mlflow

        mlflow.log_metrics({f"export_{k}": float(v) for k, v in report.items()})
        mlflow.log_artifacts("models/export", "export")
    print(f"export: {report}")
    if report["max_abs_diff"] > params.export.max_abs_diff:
        raise ParityError(
            f"ONNX vs PyTorch max probability difference {report['max_abs_diff']:.3g} exceeds "
            f"export.max_abs_diff={params.export.max_abs_diff} on {report['images']} test images"
        )


if __name__ == "__main__":
    run_stage("export", main)
