"""The figures shared by training (per-epoch val monitor), evaluation and export (variant parity).

A defect score is ``1 - p(ok)``; an image is flagged when its score is at or above the threshold.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def group_weights(groups: np.ndarray, is_defect: np.ndarray | None = None) -> np.ndarray:
    """(N,) weights that make every near-duplicate group count once: 1 / (images in its group); with
    ``is_defect``, groups are counted among the defect images and among the OK images apart.

    A group is one physical part photographed several times (exposures, retakes). Rates over images
    then estimate rates over parts, which is what a line sees: each part passes the camera once. Without
    this, one OK part shot six times is 6 of 162 val OK images (3.7%) and alone fixes a 3% threshold.
    A weighted rate counts a part in proportion to the share of its shots flagged (half its exposures
    flagged: half a part), the mean over parts of what one shot of each would do.
    """
    groups = np.asarray(groups)
    if is_defect is not None:
        is_defect = np.asarray(is_defect, dtype=bool)  # a 0/1 int array would invert wrongly under ~
        w = np.empty(len(groups))
        for part in (is_defect, ~is_defect):
            w[part] = group_weights(groups[part])
        return w
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse]


def _weights(n: int, weights: np.ndarray | None) -> np.ndarray:
    return np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)


def choose_threshold(
    defect_scores: np.ndarray, is_defect: np.ndarray, target_recall: float, weights: np.ndarray | None = None
) -> float:
    """Largest threshold t with recall(score >= t) >= target on these images; with ``weights`` (N,) the
    recall is the weighted share of the defects caught (``group_weights``: each defective part weighs one)."""
    order = np.argsort(defect_scores[is_defect], kind="stable")
    if len(order) == 0:
        raise ValueError("the validation split has no defect images: cannot choose a threshold")
    scores, w = defect_scores[is_defect][order], _weights(len(is_defect), weights)[is_defect][order]
    # the lowest-scoring defects whose weight fits in the allowed misses are missed; the cut is the next one
    missed = int(np.searchsorted(np.cumsum(w), w.sum() * (1 - target_recall) + 1e-9, side="right"))
    return float(scores[min(missed, len(scores) - 1)])


def threshold_for_false_alarms(ok_scores: np.ndarray, max_rate: float, weights: np.ndarray | None = None) -> float:
    """Smallest threshold t with false-alarm rate(score >= t) <= max_rate on these OK images; with
    ``weights`` (N,) the rate is the weighted share flagged (``group_weights``: each OK part weighs one)."""
    order = np.argsort(-ok_scores, kind="stable")
    if len(order) == 0:
        raise ValueError("the validation split has no OK images: cannot choose a threshold")
    scores, w = ok_scores[order], _weights(len(ok_scores), weights)[order]
    # the highest-scoring OK images whose weight fits in the allowed false alarms may be flagged
    allowed = int(np.searchsorted(np.cumsum(w), w.sum() * max_rate + 1e-9, side="right"))
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


def redrawn_partitions(groups: np.ndarray, cut_share: float, n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` re-drawn splits of held-out images (e.g. val and test pooled): True where an image falls on
    the side that sets the cut. Whole near-duplicate groups move together, each to the cut side with
    probability ``cut_share`` (the val split's share of the held-out images)."""
    groups = np.asarray(groups)
    unique = np.unique(groups)
    rng = np.random.default_rng(seed)
    return [np.isin(groups, unique[rng.random(len(unique)) < cut_share]) for _ in range(n)]


def cut_on_partitions(
    scores: np.ndarray,
    is_defect: np.ndarray,
    groups: np.ndarray,
    partitions: list[np.ndarray],
    max_rate: float,
    ok_by_parts: bool = True,
) -> dict:
    """How much of a figure at the val-chosen cut is the split's luck. For each partition: the cut flagging
    at most ``max_rate`` of the cut side's OK parts (``ok_by_parts``; else images), as the evaluate stage
    picks it on val, judged on the other side by images as the test split is. Means over the partitions of
    the defect recall at that cut, of whether its false alarms stay within ``max_rate`` (``within``), and of
    the recall at the other side's own ``max_rate`` point (``oracle``: the ranking alone). Partitions with
    no OK image on the cut side or no defect or OK image on the other are skipped (``partitions`` counts
    the rest)."""
    scores, is_defect, groups = np.asarray(scores), np.asarray(is_defect, dtype=bool), np.asarray(groups)
    recall, within, oracle = [], [], []
    for cut_side in partitions:
        judged = ~cut_side
        if not (cut_side & ~is_defect).any() or not (judged & is_defect).any() or not (judged & ~is_defect).any():
            continue
        ok_cut = ~is_defect[cut_side]
        w = group_weights(groups[cut_side], is_defect[cut_side])[ok_cut] if ok_by_parts else None
        cut = threshold_for_false_alarms(scores[cut_side][ok_cut], max_rate, w)
        defects, oks = scores[judged & is_defect], np.sort(scores[judged & ~is_defect])[::-1]
        recall.append((defects >= cut).mean())
        within.append((oks >= cut).mean() <= max_rate + 1e-9)
        oracle.append((defects > oks[int(max_rate * len(oks))]).mean())
    if not recall:
        return {"partitions": 0}
    return {
        "recall": float(np.mean(recall)),
        "within": float(np.mean(within)),
        "oracle": float(np.mean(oracle)),
        "partitions": len(recall),
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
