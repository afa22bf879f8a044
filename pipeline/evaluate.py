"""Evaluate: test-set metrics and the defect-vs-OK decision threshold (chosen on the val split).

The runner's decision is ``defect_score >= threshold`` with ``defect_score = 1 - p(ok)``. The
threshold is the highest one that still catches ``evaluate.target_defect_recall`` of the defects in
the validation split; the test split then tells how that choice holds on unseen images.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlflow
import numpy as np

from pipeline.plots import confusion_matrix_plot

log = logging.getLogger(__name__)


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def choose_threshold(defect_scores: np.ndarray, is_defect: np.ndarray, target_recall: float) -> float:
    """Largest threshold t with recall(score >= t) >= target on these images."""
    scores = np.sort(defect_scores[is_defect])
    if len(scores) == 0:
        raise ValueError("the validation split has no defect images: cannot choose a threshold")
    allowed_misses = int(np.floor(len(scores) * (1 - target_recall) + 1e-9))
    return float(scores[allowed_misses])


def binary_metrics(defect_scores: np.ndarray, is_defect: np.ndarray, threshold: float) -> dict:
    flagged = defect_scores >= threshold
    n_def, n_ok = int(is_defect.sum()), int((~is_defect).sum())
    return {
        "defect_recall": float(flagged[is_defect].mean()) if n_def else float("nan"),
        "false_alarm_rate": float(flagged[~is_defect].mean()) if n_ok else float("nan"),
        "binary_accuracy": float((flagged == is_defect).mean()),
    }


def classification_metrics(probs: np.ndarray, labels: np.ndarray, classes: list[str]) -> tuple[dict, np.ndarray]:
    pred = probs.argmax(axis=1)
    k = len(classes)
    cm = np.zeros((k, k), dtype=np.int64)
    np.add.at(cm, (labels, pred), 1)
    per_class = {}
    for i, c in enumerate(classes):
        tp = cm[i, i]
        per_class[c] = {
            "precision": float(tp / max(cm[:, i].sum(), 1)),
            "recall": float(tp / max(cm[i].sum(), 1)),
            "support": int(cm[i].sum()),
        }
    return {"accuracy": float((pred == labels).mean()), "per_class": per_class}, cm


def evaluate(
    val_probs: np.ndarray,
    y_val: np.ndarray,
    test_probs: np.ndarray,
    y_test: np.ndarray,
    classes: list[str],
    ok_class: str,
    target_recall: float,
    out_dir: Path,
) -> dict:
    """Probabilities (N, K) of val and test -> metrics dict; writes metrics.json and plots to out_dir."""
    ok = classes.index(ok_class)
    threshold = choose_threshold(1 - val_probs[:, ok], y_val != ok, target_recall)
    cls, cm = classification_metrics(test_probs, y_test, classes)
    test_scores = 1 - test_probs[:, ok]
    binary = binary_metrics(test_scores, y_test != ok, threshold)
    metrics = {
        "accuracy": cls["accuracy"],
        **binary,
        "threshold": threshold,
        "target_defect_recall": target_recall,
        "test_images": int(len(y_test)),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "per_class.json").write_text(json.dumps(cls["per_class"], indent=2) + "\n")
    confusion_matrix_plot(cm, classes, f"test set, accuracy {cls['accuracy']:.3f}", out_dir / "confusion_matrix.png")
    _score_histogram(test_scores, y_test != ok, threshold, out_dir / "score_histogram.png")
    with open(out_dir / "test_scores.csv", "w") as f:  # dvc plots: one row per test image
        f.write("label,is_defect,defect_score\n")
        for y, s in zip(y_test, test_scores, strict=True):
            f.write(f"{classes[y]},{int(y != ok)},{s:.6f}\n")
    return metrics


def _score_histogram(scores: np.ndarray, is_defect: np.ndarray, threshold: float, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = np.linspace(0, 1, 41)
    ax.hist(scores[~is_defect], bins=bins, alpha=0.6, label="OK images")
    ax.hist(scores[is_defect], bins=bins, alpha=0.6, label="defect images")
    ax.axvline(threshold, color="red", linestyle="--", label=f"threshold {threshold:.3f}")
    ax.set_yscale("log")
    ax.set_xlabel("defect score = 1 - p(ok)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_to_mlflow(metrics: dict, out_dir: Path) -> None:
    mlflow.log_metrics({f"test_{k}": v for k, v in metrics.items() if isinstance(v, float)})
    mlflow.log_artifacts(str(out_dir), "evaluate")
