"""Evaluation's operating points: the val-chosen thresholds and the threshold-free ROC AUC."""

from __future__ import annotations

import json

import numpy as np

from pipeline.evaluate import evaluate
from pipeline.metrics import roc_auc, threshold_for_false_alarms


def test_false_alarm_threshold_flags_at_most_the_allowed_share_of_ok_images():
    ok = np.linspace(0, 1, 100, endpoint=False)  # 0.00, 0.01, ..., 0.99
    t = threshold_for_false_alarms(ok, 0.03)
    assert (ok >= t).sum() == 3 and t - ok[96] < 1e-9  # exactly 3 flagged; the cut sits just above the 4th
    assert (ok >= threshold_for_false_alarms(ok, 0.0)).sum() == 0


def test_roc_auc_counts_pairs_ordered_right():
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.8])
    is_defect = np.array([True, True, False, False, False])
    # pairs (defect, ok): 0.9 beats all three; 0.8 beats 0.3, 0.2 and ties 0.8 -> (3 + 2.5) / 6
    assert roc_auc(scores, is_defect) == 5.5 / 6
    assert roc_auc(scores, ~is_defect) == 0.5 / 6


def test_evaluate_reports_both_operating_points_and_draws_the_roc(tmp_path):
    rng = np.random.default_rng(0)
    classes = ["crack", "ok"]

    def split(n):
        y = rng.integers(0, 2, n)
        p_ok = np.clip(np.where(y == 1, 0.8, 0.3) + rng.normal(0, 0.15, n), 0, 1)
        return np.stack([1 - p_ok, p_ok], axis=1), y

    (val_p, val_y), (test_p, test_y) = split(400), split(400)
    m = evaluate(val_p, val_y, test_p, test_y, classes, "ok", 0.98, tmp_path, max_false_alarm_rate=0.03)
    assert 0.95 < m["roc_auc"] <= 1.0
    assert m["far_threshold"] >= m["threshold"]  # fewer false alarms needs a higher cut than 98% recall
    assert m["false_alarm_rate_at_far_threshold"] < 0.08 and m["defect_recall"] >= 0.9
    assert json.loads((tmp_path / "metrics.json").read_text())["roc_auc"] == m["roc_auc"]
    assert (tmp_path / "roc.png").stat().st_size > 5_000
