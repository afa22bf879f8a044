"""The defect-vs-OK figures, shared by training (per-epoch val monitor) and evaluation.

A defect score is ``1 - p(ok)``; an image is flagged when its score is at or above the threshold.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata


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


def threshold_for_false_alarms(ok_scores: np.ndarray, max_rate: float) -> float:
    """Smallest threshold t with false-alarm rate(score >= t) <= max_rate on these OK images."""
    scores = np.sort(ok_scores)[::-1]
    if len(scores) == 0:
        raise ValueError("the validation split has no OK images: cannot choose a threshold")
    allowed = int(np.floor(len(scores) * max_rate + 1e-9))  # OK images that may be flagged
    return float(np.nextafter(scores[allowed], np.inf)) if allowed < len(scores) else 0.0


def roc_auc(scores: np.ndarray, is_defect: np.ndarray) -> float:
    """Probability that a defect image scores above an OK image (ties count half)."""
    n_pos, n_neg = int(is_defect.sum()), int((~is_defect).sum())
    if not n_pos or not n_neg:
        return float("nan")
    # Mann-Whitney U from the rank sum (tied scores share their mean rank, so a tie counts half):
    # O(n log n) and no (defects x OK images) matrix, as this runs on the val split every epoch.
    rank_sum = rankdata(scores)[is_defect].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def binary_metrics(defect_scores: np.ndarray, is_defect: np.ndarray, threshold: float) -> dict:
    flagged = defect_scores >= threshold
    n_def, n_ok = int(is_defect.sum()), int((~is_defect).sum())
    return {
        "defect_recall": float(flagged[is_defect].mean()) if n_def else float("nan"),
        "false_alarm_rate": float(flagged[~is_defect].mean()) if n_ok else float("nan"),
        "binary_accuracy": float((flagged == is_defect).mean()),
    }
