"""Stage export: fp32, fp16 and int8 ONNX (uint8 in, probabilities + defect score out), each scored on
the test set against PyTorch, gated, and described by its model card."""

import dataclasses
import json
from pathlib import Path

import numpy as np

from pipeline import tracking
from pipeline.bench import torch_scorer
from pipeline.entry import run_stage
from pipeline.export import ParityError, export_onnx
from pipeline.metrics import softmax
from pipeline.plots import variants_plot
from pipeline.prepare import load_split, read_summary
from pipeline.runtime import resolve_runtime
from pipeline.train import load_model, load_tile_model, predict_logits
from pipeline.variants import (
    calibration_images,
    compare,
    finish_cards,
    gate,
    latencies,
    make_fp16,
    make_int8,
    recommend,
    scores,
    variant_path,
    with_tile_graph,
)
from serving.card import InputSpec, ModelCard, TileSpec, card_path_for, sha256_file
from serving.preprocess import decode_image
from serving.runner import Runner
from serving.tiles import tile_graph_path

NUMERIC = (
    "accuracy",
    "defect_recall",
    "false_alarm_rate",
    "decision_flips",
    "score_max_abs_diff",
    "score_mean_abs_diff",
    "prob_max_abs_diff",
    "model_bytes",
    "speedup_vs_fp32",
)


def main(params):
    cfg, prepared = params.export, Path("data/prepared")
    net, meta = load_model(Path("models/train/model.pt"))
    threshold = json.loads(Path("reports/evaluate/metrics.json").read_text())["threshold"]
    card = ModelCard(
        name=params.mlflow.experiment,
        architecture=meta["architecture"],
        classes=meta["classes"],
        ok_class=meta["ok_class"],
        input=InputSpec(meta["image_size"], meta["channels"], meta["resize"]),
        threshold=threshold,
        training_run_id=tracking.read_run_id(Path("models/train/run.json")),
        data_fingerprint=meta["fingerprint"],
    )
    tiles = load_tile_model(Path("models/train/model.pt"))
    if tiles:
        tnet, tmeta = tiles
        spec = TileSpec("", "", tmeta["tile"], tmeta["weight"], tmeta["architecture"])
        card = dataclasses.replace(card, tiles=spec)
    fp32 = Path("models/export/model.onnx")
    paths = {v: variant_path(fp32, v) for v in ("fp32", *cfg.variants)}
    tile_paths = {v: tile_graph_path(p) for v, p in paths.items()}
    graphs = [(net, meta["image_size"], paths, prepared)]  # network, input side, file per variant, calibration data
    if tiles:
        graphs.append((tnet, tmeta["tile"], tile_paths, prepared / "tiles"))
    for graph, size, files, data in graphs:  # each graph in every variant
        export_onnx(graph, card.ok_index, size, meta["channels"], cfg.opset, files["fp32"], card)
        if "fp16" in files:
            make_fp16(files["fp32"], files["fp16"])
        if "int8" in files:
            x_train, _, _ = load_split(data, "train")
            calibration = calibration_images(x_train, cfg.int8.calibration_images, 0)
            make_int8(files["fp32"], files["int8"], calibration, cfg)
    for v, path in paths.items():  # provisional cards, so the runner (which checks the sha256) loads them
        c = with_tile_graph(card, tile_paths[v]) if tiles else card
        dataclasses.replace(c, variant=v, sha256=sha256_file(path)).write(card_path_for(path))

    # Every variant, through the edge runner itself, against PyTorch on all test images: with tiles, the
    # photographs at full resolution, each scored as the runner does (its letterbox and its tiles).
    x_test, y_test, test_paths = load_split(prepared, "test")
    if tiles:  # one at a time (many sizes), both views as the runner scores them: pipeline.bench.torch_scorer
        photos = [decode_image(Path("data/raw/images") / p, meta["channels"]) for p in test_paths]
        score = torch_scorer(net, tnet, card)
        torch_probs = np.concatenate([score(f[None]) for f in photos])
    else:
        torch_probs = softmax(predict_logits(net, x_test, resolve_runtime("cpu", "fp32")))
    runners = {v: Runner(p, providers="cpu", spin=False, force=True) for v, p in paths.items()}
    report = {}
    batches = [f[None] for f in photos] if tiles else [x_test]  # photographs of many sizes: one at a time
    for v, runner in runners.items():
        probs = np.concatenate([runner.predict(b)[0] for b in batches])
        report[v] = {
            **scores(probs, y_test, card.classes, card.ok_index, threshold),
            **compare(torch_probs, probs, test_paths, card.ok_index, threshold),
            "model_bytes": paths[v].stat().st_size + (tile_paths[v].stat().st_size if tiles else 0),
        }
    # latency: with tiles, the first test photograph (its letterbox and its tiles) in batches of its copies
    lat = latencies(runners, np.stack([photos[0]] * len(photos)) if tiles else x_test, cfg.latency_repeats, [1, 32])
    for v in report:
        report[v]["latency"] = lat[v]
        report[v]["speedup_vs_fp32"] = lat["fp32"]["batch_1_p50_ms"] / lat[v]["batch_1_p50_ms"]
    reasons = gate(report, cfg)
    recommended = recommend(report, reasons)
    for v in report:
        report[v] |= {"deployable": not reasons[v], "not_deployable_reason": reasons[v]}
    finish_cards(card, paths, report, reasons, recommended, tile_paths if tiles else None)

    out = Path("reports/export")
    out.mkdir(parents=True, exist_ok=True)
    (out / "variants.json").write_text(json.dumps({"recommended": recommended, "variants": report}, indent=2) + "\n")
    metrics = {v: {k: float(r[k]) for k in NUMERIC} | {"deployable": int(not reasons[v])} for v, r in report.items()}
    (out / "parity.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "variants.md").write_text(markdown_table(report, recommended, read_summary(prepared)["classes"]))
    variants_plot(report, out / "variants.png")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="export") as run:
        run.log_metrics({f"export_{v}_{k}": val for v, m in metrics.items() for k, val in m.items()})
        run.set_tags({f"export.recommended.{p}": v for p, v in recommended.items()})
        run.log_artifacts("models/export", "export")
        run.log_artifacts(out, "export_report")
    for v, r in report.items():
        state = "deployable" if r["deployable"] else f"NOT deployable: {r['not_deployable_reason']}"
        print(
            f"export {v}: accuracy {r['accuracy']:.3f}, defect recall {r['defect_recall']:.3f}, "
            f"{r['decision_flips']} flips, {r['latency']['batch_1_p50_ms']:.1f} ms, {state}"
        )
    print(f"export: recommended {recommended}")
    if reasons["fp32"]:
        raise ParityError(
            f"the fp32 export itself is broken: ONNX vs PyTorch max probability difference "
            f"{report['fp32']['prob_max_abs_diff']:.3g} exceeds export.max_abs_diff={cfg.max_abs_diff} "
            f"on {len(y_test)} test images"
        )


def markdown_table(report: dict, recommended: dict, classes: list[str]) -> str:
    cols = (
        "variant | deployable | accuracy | defect recall | false alarms | flips | score max diff | MB | ms b1 | ms b32"
    )
    head = f"| {cols} |"
    lines = ["# Export variants (test set, at the model card's threshold)", "", head, "|" + "---|" * 10]
    for v, r in report.items():
        lines.append(
            f"| {v} | {'yes' if r['deployable'] else 'no: ' + r['not_deployable_reason']} | {r['accuracy']:.3f} "
            f"| {r['defect_recall']:.3f} | {r['false_alarm_rate']:.3f} | {r['decision_flips']} "
            f"| {r['score_max_abs_diff']:.2g} | {r['model_bytes'] / 1e6:.1f} | {r['latency']['batch_1_p50_ms']:.1f} "
            f"| {r['latency']['batch_32_p50_ms']:.0f} |"
        )
    lines += [
        "",
        "Per-class recall:",
        "",
        "| variant | " + " | ".join(classes) + " |",
        "|" + "---|" * (len(classes) + 1),
    ]
    for v, r in report.items():
        lines.append(f"| {v} | " + " | ".join(f"{r['per_class_recall'][c]:.3f}" for c in classes) + " |")
    lines += ["", f"Recommended per execution provider: {recommended}", ""]
    for v, r in report.items():
        if r["flipped_images"]:
            lines.append(f"- {v} flips the decision on: {', '.join(r['flipped_images'])}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_stage("export", main)
