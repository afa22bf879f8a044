"""Export variants: fp16 and int8 ONNX files beside the fp32 one, each proven on the whole test set.

- fp16: weights and activations in half precision (onnxruntime's converter); the uint8 image input and
  the float32 outputs stay as the runner expects them (``keep_io_types``).
- int8: static quantization in QDQ format with per-channel weights, calibrated on images drawn from
  the training split (count and method in ``export.int8``). Only the op types listed there are
  quantized; everything else (the normalization at the input, softmax) stays float. EfficientNet's
  SiLU and squeeze-excite are known to suffer in int8; tf_efficientnet_lite0 has neither.

Every variant is scored against the fp32 model on the test images (accuracy, per-class recall, defect
recall and false alarms at the card's threshold, decisions that flip and which images, score
differences, file size, latency side by side) and gated: a variant that loses too much recall or
accuracy, raises the false alarms too much, or is not fast enough, stays on disk for inspection but
its card says it is not deployable and why. The card also names the variant to use per execution provider.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.transformers.float16 import convert_float_to_float16

from pipeline.config import ExportConfig
from pipeline.export.onnx import set_card_metadata
from pipeline.export.timing import batches, interleaved
from pipeline.metrics import binary_metrics, classification_metrics
from serving.card import REVIEW_REASON, ModelCard, card_path_for, sha256_file
from serving.runner import Runner

log = logging.getLogger(__name__)


def variant_path(fp32_path: Path, variant: str) -> Path:
    """``models/export/model.onnx`` -> ``model.fp16.onnx`` / ``model.int8.onnx`` (fp32 keeps its name)."""
    return fp32_path if variant == "fp32" else fp32_path.with_name(f"{fp32_path.stem}.{variant}.onnx")


def make_fp16(fp32_path: Path, out: Path) -> None:
    model = convert_float_to_float16(onnx.load(str(fp32_path)), keep_io_types=True)
    onnx.save(model, str(out))


def make_int8(fp32_path: Path, out: Path, calibration: np.ndarray, cfg: ExportConfig) -> None:
    """QDQ static quantization calibrated on ``calibration`` (N, S, S, C) uint8 training images."""

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"image": calibration[i : i + 16]} for i in range(0, len(calibration), 16)])

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    fp32_path, out = fp32_path.resolve(), out.resolve()
    # onnxruntime's shape inference writes temporary files (70 MB for an ensemble) into the working
    # directory and leaves them when it fails: run it inside the temporary folder, which is removed.
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        pre = Path(tmp) / "pre.onnx"
        try:  # shape inference + graph optimizations first
            quant_pre_process(str(fp32_path), str(pre))
        except Exception as exc:  # onnxruntime's symbolic shape inference gives up on some graphs (ensembles)
            log.warning("int8: symbolic shape inference failed (%s); quantizing with ONNX shape inference only", exc)
            quant_pre_process(str(fp32_path), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre),
            str(out),
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=cfg.int8.per_channel,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod[cfg.int8.calibration_method],
            op_types_to_quantize=cfg.int8.op_types,
            nodes_to_exclude=cfg.int8.exclude_nodes,
        )


def with_tile_graph(card: ModelCard, tile_path: Path) -> ModelCard:
    """``card`` naming ``tile_path`` (beside its whole-image graph) as its tile graph, with that file's sha256."""
    return dataclasses.replace(
        card, tiles=dataclasses.replace(card.tiles, model=tile_path.name, sha256=sha256_file(tile_path))
    )


def write_card(card: ModelCard, path: Path) -> ModelCard:
    """Bind ``card`` to the graph at ``path``: checked against the card schema (an export never writes a card
    the runner would refuse), embedded in the graph's metadata with its own sha256, then written as the sidecar
    with the file's sha256. Returns the sidecar's card."""
    ModelCard.from_dict(json.loads(card.to_json()), f"the card for {path}")
    model = onnx.load(str(path))
    set_card_metadata(model, card)
    onnx.save(model, str(path))
    card = dataclasses.replace(card, sha256=sha256_file(path))
    card.write(card_path_for(path))
    return card


def calibration_images(images: np.ndarray, count: int, seed: int) -> np.ndarray:
    idx = np.random.default_rng(seed).permutation(len(images))[:count]
    return images[np.sort(idx)]


def scores(
    probs: np.ndarray, labels: np.ndarray, classes: list[str], ok_index: int | None, threshold: float | None
) -> dict:
    """Accuracy, per-class recall and the worst class's, and defect recall / false-alarm rate at the threshold
    (as evaluate does; defect-type sorting, ``ok_index`` None: no threshold, no defect recall)."""
    cls, _ = classification_metrics(probs, labels, classes)
    recalls = {c: m["recall"] for c, m in cls["per_class"].items()}
    out = {
        "accuracy": cls["accuracy"],
        "per_class_recall": recalls,
        "min_class_recall": min(r for c, r in recalls.items() if cls["per_class"][c]["support"]),
    }
    if ok_index is None:
        return out
    binary = binary_metrics(1.0 - probs[:, ok_index], labels != ok_index, threshold)
    return out | {"defect_recall": binary["defect_recall"], "false_alarm_rate": binary["false_alarm_rate"]}


def compare(
    reference: np.ndarray, probs: np.ndarray, paths: list[str], ok_index: int | None, threshold: float | None
) -> dict:
    """How a variant's outputs differ from PyTorch's on the same images: decisions that flip (the defect/OK
    decision at the threshold; sorting: the most likely class) and the score's differences (1 - p(ok);
    sorting: the most likely class's probability)."""
    if ok_index is None:
        ref_score, score = reference.max(axis=1), probs.max(axis=1)
        flips = np.nonzero(reference.argmax(axis=1) != probs.argmax(axis=1))[0]
    else:
        ref_score, score = 1.0 - reference[:, ok_index], 1.0 - probs[:, ok_index]
        flips = np.nonzero((ref_score >= threshold) != (score >= threshold))[0]
    return {
        "decision_flips": int(len(flips)),
        "flipped_images": [paths[i] for i in flips][:50],
        "score_max_abs_diff": float(np.abs(ref_score - score).max()),
        "score_mean_abs_diff": float(np.abs(ref_score - score).mean()),
        "prob_max_abs_diff": float(np.abs(reference - probs).max()),
    }


def latencies(runners: dict[str, Runner], images: np.ndarray, repeats: int, batch_sizes: list[int]) -> dict:
    """p50 latency per variant and batch size on the runner's provider, interleaved in one process."""
    out: dict[str, dict] = {v: {} for v in runners}
    for bs in batch_sizes:
        batch = batches(images, bs)
        calls = {v: (lambda r=r, b=batch: r.predict(b)) for v, r in runners.items()}
        res = interleaved(calls, bs, repeats, warmup=2)
        for v in runners:
            out[v][f"batch_{bs}_p50_ms"] = res[v]["p50_ms"]
    return out


# What a variant may lose against fp32 on the test set: (label, report key, direction, export.* limit).
# The false alarms catch a variant whose scores all moved up (one ensemble's int8 export flagged every
# OK part while its recall rose and its accuracy fell by 0.011).
LIMITS = (
    ("defect recall", "defect_recall", "drop", "max_defect_recall_drop"),
    ("accuracy", "accuracy", "drop", "max_accuracy_drop"),
    ("false alarms", "false_alarm_rate", "rise", "max_false_alarm_rise"),
)


def gate(report: dict, cfg: ExportConfig, operating_point: dict | None = None) -> dict[str, str]:
    """The reason each variant is not deployable ('' when it is), against fp32 and export.* limits. A model
    whose ``operating_point`` (evaluate's) is below target is marked for review in every variant unless
    ``export.deploy_below_target``. Defect-type sorting (no defect recall in the report): each class's
    recall may drop by at most ``export.max_defect_recall_drop``, the accuracy by ``max_accuracy_drop``."""
    ref = report["fp32"]
    reasons = {}
    for v, r in report.items():
        why = []
        if operating_point and operating_point["status"] != "meets target" and not cfg.deploy_below_target:
            why.append(
                f"{REVIEW_REASON}: at the {operating_point['max_false_alarm_rate']:.1%} false-alarm ceiling "
                f"it catches {operating_point['val_defect_recall']:.1%} of the val defects, below the "
                f"{operating_point['target_defect_recall']:.1%} target (export.deploy_below_target: false)"
            )
        if v == "fp32":
            if r["prob_max_abs_diff"] > cfg.max_abs_diff:
                why.append(f"differs from PyTorch by {r['prob_max_abs_diff']:.3g} > export.max_abs_diff")
        else:
            for label, key, word, limit in LIMITS:
                if key not in r:  # defect-type sorting: no defect recall, no false alarms
                    continue
                change = r[key] - ref[key] if word == "rise" else ref[key] - r[key]
                if change > getattr(cfg, limit):
                    why.append(
                        f"{label} {r[key]:.3f} vs fp32 {ref[key]:.3f}: {word} {change:.3f} > "
                        f"export.{limit}={getattr(cfg, limit)}"
                    )
            if "defect_recall" not in r:
                for c, rec in r["per_class_recall"].items():
                    drop = ref["per_class_recall"][c] - rec
                    if drop > cfg.max_defect_recall_drop:
                        why.append(
                            f"recall of {c} {rec:.3f} vs fp32 {ref['per_class_recall'][c]:.3f}: drop {drop:.3f} > "
                            f"export.max_defect_recall_drop={cfg.max_defect_recall_drop}"
                        )
            need = cfg.min_speedup.get(v, 0.0)
            if r["speedup_vs_fp32"] < need:
                why.append(f"speedup {r['speedup_vs_fp32']:.2f}x < export.min_speedup.{v}={need}")
        reasons[v] = "; ".join(why)
    return reasons


def recommend(report: dict, reasons: dict[str, str]) -> dict[str, str]:
    """The variant to run per execution provider, among the deployable ones.

    CPU: the fastest at batch 1 as measured here. CUDA: fp16 (int8 QDQ on the plain CUDA provider is
    slower than fp32: it has no int8 convolution kernels). TensorRT: int8, else fp16 (it builds int8
    engines from QDQ graphs). A provider whose candidates all failed gets fp32.
    """
    ok = [v for v in report if not reasons[v]]
    if not ok:
        return {}
    cpu = min(ok, key=lambda v: report[v]["latency"]["batch_1_p50_ms"])

    def first(*order: str) -> str:
        return next((v for v in order if v in ok), ok[0])

    return {"cpu": cpu, "cuda": first("fp16", "fp32"), "tensorrt": first("int8", "fp16", "fp32")}


def finish_cards(
    base: ModelCard,
    paths: dict[str, Path],
    report: dict,
    reasons: dict,
    recommended: dict,
    tile_paths: dict[str, Path] | None = None,
) -> None:
    """Write each variant's card: in its ONNX metadata and as the sidecar with the file's sha256 (and its
    tile graph's, from ``tile_paths``, where the model has tiles)."""
    for v, path in paths.items():
        if tile_paths:
            base = with_tile_graph(base, tile_paths[v])
        figures = {k: val for k, val in report[v].items() if k != "flipped_images"}
        card = dataclasses.replace(
            base,
            variant=v,
            deployable=not reasons[v],
            not_deployable_reason=reasons[v],
            parity=figures,
            recommended=recommended,
        )
        write_card(card, path)
