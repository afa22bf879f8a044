"""The figures shared by training (per-epoch val monitor), evaluation and export (variant parity).

A defect score is ``1 - p(ok)``; an image is flagged when its score is at or above the threshold.
"""

from __future__ import annotations

import math

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
        allowed = int(max_rate * len(oks))  # all of them at max_rate 1: no OK image bounds the oracle's cut
        oracle.append((defects > oks[allowed]).mean() if allowed < len(oks) else 1.0)
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


def _logit(p: float) -> float:
    p = min(max(p, 1e-7), 1 - 1e-7)
    return math.log(p / (1 - p))


def _logit_middle(low: float, high: float) -> float:
    """The middle of [low, high] in logit space (scores near 0 or 1 spread out there), within [low, high]."""
    middle = 1 / (1 + math.exp(-(_logit(low) + _logit(high)) / 2))
    return min(max(middle, low), high)  # the clamp only guards float rounding


def operating_point(
    scores: np.ndarray,
    is_defect: np.ndarray,
    target_recall: float,
    max_false_alarm_rate: float,
    weights: np.ndarray | None = None,
) -> dict:
    """The card's threshold, chosen on val: it never flags more than ``max_false_alarm_rate`` of the OK
    images (the line's ceiling) and catches ``target_recall`` of the defects where the ceiling allows.

    ``recall_cut`` (``choose_threshold``) is the highest threshold meeting the recall target, ``ceiling_cut``
    (``threshold_for_false_alarms``) the lowest within the ceiling. When ``ceiling_cut <= recall_cut`` every
    threshold between them meets both on val, and the card takes their middle in logit space: a margin on
    both sides for the images the line sends next ("meets target"). Otherwise no threshold meets both: the
    card takes ``ceiling_cut``, the status is "below target" and ``val_defect_recall`` says what the model
    does catch there. ``weights``: ``group_weights`` (each near-duplicate part counts once)."""
    w = _weights(len(is_defect), weights)
    recall_cut = choose_threshold(scores, is_defect, target_recall, w)
    ceiling_cut = threshold_for_false_alarms(scores[~is_defect], max_false_alarm_rate, w[~is_defect])
    above = scores[scores >= ceiling_cut]  # the ceiling's cut sits a hair above an OK image: move it halfway up
    if len(above) and ceiling_cut > 0:  # to the next score, which flags the same val images with a margin
        ceiling_cut = _logit_middle(float(np.nextafter(ceiling_cut, -np.inf)), float(above.min()))
    meets = ceiling_cut <= recall_cut
    threshold = _logit_middle(ceiling_cut, recall_cut) if meets else ceiling_cut
    flagged = scores >= threshold
    return {
        "status": "meets target" if meets else "below target",
        "threshold": float(threshold),
        "target_defect_recall": target_recall,
        "max_false_alarm_rate": max_false_alarm_rate,
        "val_defect_recall": float(w[is_defect & flagged].sum() / w[is_defect].sum()),
        "val_false_alarm_rate": float(w[~is_defect & flagged].sum() / w[~is_defect].sum()),
        "recall_cut": recall_cut,
        "ceiling_cut": ceiling_cut,
    }


def small_split_warnings(n_defect: int, n_ok: int, target_recall: float, max_false_alarm_rate: float) -> list[str]:
    """Why a val-chosen threshold may not hold: too few images to resolve the recall target or the
    false-alarm ceiling (one image is then more than the share the target or the ceiling leaves)."""
    warnings = []
    if n_defect * (1 - target_recall) < 1:
        warnings.append(
            f"the val split has {n_defect} defect parts: one is {1 / max(n_defect, 1):.1%} of recall, so the "
            f"{target_recall:.0%} target means missing none of them; the test and the line can miss more"
        )
    if n_ok * max_false_alarm_rate < 1:
        warnings.append(
            f"the val split has {n_ok} OK parts: one is {1 / max(n_ok, 1):.1%} of false alarms, so the "
            f"{max_false_alarm_rate:.0%} ceiling means flagging none of them; the test and the line can flag more"
        )
    return warnings
