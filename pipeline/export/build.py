"""The export stage's work: the trained model as ONNX graphs (uint8 in, probabilities + defect score out)
in every variant (fp32, fp16, int8), each scored through the edge runner itself against the PyTorch
reference on the test set, gated, and described by its model card (ONNX metadata and sidecar JSON).

With a tile model every variant has a tile graph beside it, and parity is judged on the test photographs
at full resolution, scored as the runner scores them (its letterbox and its tiles, fused).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import tracking
from pipeline.config import ExportConfig
from pipeline.data.prepare import load_split, ok_index
from pipeline.export.onnx import export_onnx
from pipeline.export.reference import torch_scorer
from pipeline.export.variants import (
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
    write_card,
)
from pipeline.metrics import softmax
from pipeline.model import load_model, load_tile_model, predict_logits
from pipeline.plots import variants_plot
from pipeline.runtime import resolve_runtime
from serving.card import SORTING_OUTPUTS, InputSpec, ModelCard, TileSpec
from serving.preprocess import decode_image
from serving.runner import Runner
from serving.tiles import tile_graph_path

# the figures of each variant that parity.json (DVC metrics) carries
NUMERIC = (
    "accuracy",
    "min_class_recall",
    "defect_recall",  # not in a defect-type sorting report
    "false_alarm_rate",  # idem
    "decision_flips",
    "score_max_abs_diff",
    "score_mean_abs_diff",
    "prob_max_abs_diff",
    "model_bytes",
    "speedup_vs_fp32",
)


@dataclass(frozen=True)
class Inputs:
    """Where the export stage reads (dvc.yaml deps)."""

    model: Path = Path("models/train/model.pt")
    run: Path = Path("models/train/run.json")
    evaluation: Path = Path("reports/evaluate/metrics.json")
    prepared: Path = Path("data/prepared")
    images: Path = Path("data/raw/images")


@dataclass
class Export:
    """What the export wrote and measured."""

    card: ModelCard  # the fp32 card without per-variant figures
    report: dict  # per variant: scores, parity against PyTorch, bytes, latency, deployable
    reasons: dict[str, str]  # per variant: why it is not deployable ('' when it is)
    recommended: dict[str, str]  # execution provider -> variant
    test_images: int


def export_model(cfg: ExportConfig, name: str, src: Inputs, fp32: Path) -> Export:
    """Every variant of the trained model next to ``fp32`` (``models/export/model.onnx``), gated and carded."""
    net, meta = load_model(src.model)
    tiles = load_tile_model(src.model)
    card = base_card(name, meta, tiles, src)
    paths = {v: variant_path(fp32, v) for v in ("fp32", *cfg.variants)}
    tile_paths = {v: tile_graph_path(p) for v, p in paths.items()} if tiles else None
    graphs = [(net, meta["image_size"], paths, src.prepared)]  # network, input side, file per variant, calibration
    if tiles:
        graphs.append((tiles[0], tiles[1]["tile"], tile_paths, src.prepared / "tiles"))
    for graph, size, files, data in graphs:  # each graph in every variant
        write_variants(cfg, graph, card, ok_index(meta), size, meta["channels"], files, data)
    for v, path in paths.items():  # provisional cards, so the runner (which checks the card and sha256) loads them
        write_card(dataclasses.replace(with_tile_graph(card, tile_paths[v]) if tiles else card, variant=v), path)
    report, n_test = parity(cfg, net, tiles, meta, card, paths, tile_paths, src)
    reasons = gate(report, cfg, card.operating_point)
    recommended = recommend(report, reasons)
    for v in report:
        report[v] |= {"deployable": not reasons[v], "not_deployable_reason": reasons[v]}
    finish_cards(card, paths, report, reasons, recommended, tile_paths)
    return Export(card, report, reasons, recommended, n_test)


def base_card(name: str, meta: dict, tiles: tuple | None, src: Inputs) -> ModelCard:
    """The facts the runner needs, from the trained model and the evaluate stage's threshold."""
    evaluation = json.loads(src.evaluation.read_text())
    point = evaluation.get("operating_point") or {}
    card = ModelCard(
        name=name,
        architecture=meta["architecture"],
        classes=meta["classes"],
        ok_class=meta["ok_class"],  # None: defect-type sorting (and no threshold)
        input=InputSpec(meta["image_size"], meta["channels"], meta["resize"]),
        threshold=evaluation["threshold"],
        training_run_id=tracking.read_run_id(src.run),
        data_fingerprint=meta["fingerprint"],
        operating_point={k: v for k, v in point.items() if k not in ("recall_cut", "ceiling_cut")},
    )
    if card.ok_class is None:  # the graph's second output is the most likely class's probability
        card = dataclasses.replace(card, outputs=dict(SORTING_OUTPUTS))
    if not tiles:
        return card
    tmeta = tiles[1]
    return dataclasses.replace(card, tiles=TileSpec("", "", tmeta["tile"], tmeta["weight"], tmeta["architecture"]))


def write_variants(
    cfg: ExportConfig,
    net,
    card: ModelCard,
    ok: int | None,
    size: int,
    channels: int,
    files: dict[str, Path],
    data: Path,
) -> None:
    """One network as fp32 ONNX, then fp16 and int8 (calibrated on ``data``'s training split) where asked;
    ``ok``: the OK class's index (None: defect-type sorting, the graph's score is the top probability)."""
    export_onnx(net, ok, size, channels, cfg.opset, files["fp32"], card)
    if "fp16" in files:
        make_fp16(files["fp32"], files["fp16"])
    if "int8" in files:
        x_train, _, _ = load_split(data, "train")
        make_int8(files["fp32"], files["int8"], calibration_images(x_train, cfg.int8.calibration_images, 0), cfg)


def parity(
    cfg: ExportConfig,
    net,
    tiles: tuple | None,
    meta: dict,
    card: ModelCard,
    paths: dict[str, Path],
    tile_paths: dict[str, Path] | None,
    src: Inputs,
) -> tuple[dict, int]:
    """Every variant, through the edge runner itself, against PyTorch on all test images: with tiles, the
    photographs at full resolution, one at a time (many sizes), both views as the runner scores them."""
    x_test, y_test, test_paths = load_split(src.prepared, "test")
    if tiles:
        photos = [decode_image(src.images / p, meta["channels"]) for p in test_paths]
        score = torch_scorer(net, tiles[0], card)
        torch_probs = np.concatenate([score(f[None]) for f in photos])
    else:
        torch_probs = softmax(predict_logits(net, x_test, resolve_runtime("cpu", "fp32")))
    runners = {v: Runner(p, providers="cpu", spin=False, force=True) for v, p in paths.items()}
    report = {}
    batches = [f[None] for f in photos] if tiles else [x_test]
    for v, runner in runners.items():
        probs = np.concatenate([runner.predict(b)[0] for b in batches])
        report[v] = {
            **scores(probs, y_test, card.classes, ok_index(meta), card.threshold),
            **compare(torch_probs, probs, test_paths, ok_index(meta), card.threshold),
            "model_bytes": paths[v].stat().st_size + (tile_paths[v].stat().st_size if tiles else 0),
        }
    # latency: with tiles, the first test photograph (its letterbox and its tiles) in batches of its copies
    lat = latencies(runners, np.stack([photos[0]] * len(photos)) if tiles else x_test, cfg.latency_repeats, [1, 32])
    for v in report:
        report[v]["latency"] = lat[v]
        report[v]["speedup_vs_fp32"] = lat["fp32"]["batch_1_p50_ms"] / lat[v]["batch_1_p50_ms"]
    return report, len(y_test)


def write_reports(e: Export, out: Path) -> dict:
    """variants.json, parity.json (DVC metrics, returned), variants.md and variants.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    report = e.report
    (out / "variants.json").write_text(json.dumps({"recommended": e.recommended, "variants": report}, indent=2) + "\n")
    metrics = {
        v: {k: float(r[k]) for k in NUMERIC if k in r} | {"deployable": int(not e.reasons[v])}
        for v, r in report.items()
    }
    (out / "parity.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "variants.md").write_text(markdown_table(report, e.recommended, e.card.classes))
    variants_plot(report, out / "variants.png")
    return metrics


def markdown_table(report: dict, recommended: dict, classes: list[str]) -> str:
    cols = (
        "variant | deployable | accuracy | defect recall | false alarms | flips | score max diff | MB | ms b1 | ms b32"
    )
    lines = ["# Export variants (test set, at the model card's threshold)", "", f"| {cols} |", "|" + "---|" * 10]
    for v, r in report.items():
        lines.append(
            f"| {v} | {'yes' if r['deployable'] else 'no: ' + r['not_deployable_reason']} | {r['accuracy']:.3f} "
            f"| {r.get('defect_recall', float('nan')):.3f} | {r.get('false_alarm_rate', float('nan')):.3f} "
            f"| {r['decision_flips']} "
            f"| {r['score_max_abs_diff']:.2g} | {r['model_bytes'] / 1e6:.1f} | {r['latency']['batch_1_p50_ms']:.1f} "
            f"| {r['latency']['batch_32_p50_ms']:.0f} |"
        )
    lines += ["", "Per-class recall:", "", "| variant | " + " | ".join(classes) + " |"]
    lines.append("|" + "---|" * (len(classes) + 1))
    for v, r in report.items():
        lines.append(f"| {v} | " + " | ".join(f"{r['per_class_recall'][c]:.3f}" for c in classes) + " |")
    lines += ["", f"Recommended per execution provider: {recommended}", ""]
    for v, r in report.items():
        if r["flipped_images"]:
            lines.append(f"- {v} flips the decision on: {', '.join(r['flipped_images'])}")
    return "\n".join(lines) + "\n"


def summary_lines(e: Export) -> list[str]:
    lines = []
    for v, r in e.report.items():
        state = "deployable" if r["deployable"] else f"NOT deployable: {r['not_deployable_reason']}"
        recall = (
            f"defect recall {r['defect_recall']:.3f}"
            if "defect_recall" in r
            else (f"worst class recall {r['min_class_recall']:.3f}")
        )
        lines.append(
            f"export {v}: accuracy {r['accuracy']:.3f}, {recall}, "
            f"{r['decision_flips']} flips, {r['latency']['batch_1_p50_ms']:.1f} ms, {state}"
        )
    return lines + [f"export: recommended {e.recommended}"]
