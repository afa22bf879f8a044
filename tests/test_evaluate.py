"""Evaluation's operating points: the val-chosen thresholds and the threshold-free ROC AUC."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PIL import Image

from pipeline.evaluation.evaluate import evaluate, review_sheet
from pipeline.metrics import (
    choose_threshold,
    cut_on_partitions,
    group_weights,
    redrawn_partitions,
    roc_auc,
    threshold_for_false_alarms,
)
from pipeline.plots import curves_plot, y_scale


def test_false_alarm_threshold_flags_at_most_the_allowed_share_of_ok_images():
    ok = np.linspace(0, 1, 100, endpoint=False)  # 0.00, 0.01, ..., 0.99
    t = threshold_for_false_alarms(ok, 0.03)
    assert (ok >= t).sum() == 3 and t - ok[96] < 1e-9  # exactly 3 flagged; the cut sits just above the 4th
    assert (ok >= threshold_for_false_alarms(ok, 0.0)).sum() == 0


def line_of_parts(n_parts: int, shots: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """OK scores and groups of ``n_parts`` parts, part i scoring i / n_parts; ``shots``: parts photographed
    more than once (part: images), like one tile at six exposures."""
    groups = [f"part{i}" for i in range(n_parts) for _ in range(shots.get(i, 1))]
    scores = [i / n_parts for i in range(n_parts) for _ in range(shots.get(i, 1))]
    return np.array(scores), np.array(groups)


def test_one_part_shot_six_times_does_not_set_the_false_alarm_threshold_alone():
    # 100 OK parts; the highest-scoring one was photographed six times (6 of 105 images, 5.7%).
    ok, groups = line_of_parts(100, {99: 6})
    per_image = threshold_for_false_alarms(ok, 0.03)
    per_part = threshold_for_false_alarms(ok, 0.03, group_weights(groups))
    assert per_image > ok.max()  # counted by images, that one part alone is over 3%: nothing may be flagged
    flagged = set(groups[ok >= per_part])
    assert flagged == {"part99", "part98", "part97"}  # by parts: 3 of 100 parts, the six shots counted once
    assert group_weights(groups).sum() == 100


def test_group_weighted_recall_target_counts_each_defective_part_once():
    # 50 defective parts scoring 0.5..0.99; the weakest one photographed six times.
    scores = np.array([0.5] * 6 + [0.5 + i / 100 for i in range(1, 50)])
    groups = np.array(["weak"] * 6 + [f"d{i}" for i in range(1, 50)])
    is_defect = np.ones(len(scores), bool)
    assert choose_threshold(scores, is_defect, 0.98) == 0.5  # by images the six shots must all be caught
    t = choose_threshold(scores, is_defect, 0.98, group_weights(groups, is_defect))
    assert t == 0.51  # by parts the weak part is the 1 of 50 (2%) a 98% target may miss


def test_roc_auc_counts_pairs_ordered_right():
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.8])
    is_defect = np.array([True, True, False, False, False])
    # pairs (defect, ok): 0.9 beats all three; 0.8 beats 0.3, 0.2 and ties 0.8 -> (3 + 2.5) / 6
    assert roc_auc(scores, is_defect) == 5.5 / 6
    assert roc_auc(scores, ~is_defect) == 0.5 / 6


def scored_split(rng, n, separation):
    """Two classes (crack 0, ok 1): p(ok) around 0.5 +- separation / 2, noise 0.15."""
    y = rng.integers(0, 2, n)
    p_ok = np.clip(np.where(y == 1, 0.5 + separation / 2, 0.5 - separation / 2) + rng.normal(0, 0.15, n), 0, 1)
    return np.stack([1 - p_ok, p_ok], axis=1), y


def test_a_model_that_cannot_reach_the_recall_target_under_the_ceiling_is_marked_below_target(tmp_path):
    """The case a line must never run silently: a model that ranks fairly (AUC ~0.99) but catches 98% of the
    defects only by flagging many good parts. The card's threshold keeps the false-alarm ceiling and says
    how much it then catches."""
    rng = np.random.default_rng(0)
    (val_p, val_y), (test_p, test_y) = scored_split(rng, 400, 0.5), scored_split(rng, 400, 0.5)
    m = evaluate(val_p, val_y, test_p, test_y, ["crack", "ok"], "ok", 0.98, tmp_path, max_false_alarm_rate=0.03)
    point = m["operating_point"]
    assert 0.95 < m["roc_auc"] <= 1.0
    assert point["status"] == "below target" and point["val_false_alarm_rate"] <= 0.03
    assert 0.5 < point["val_defect_recall"] < 0.98  # what it does catch, said on the card
    assert m["threshold"] == point["ceiling_cut"] > point["recall_cut"]  # the ceiling wins over the target
    assert m["false_alarm_rate"] < 0.08  # and holds on the test split
    assert json.loads((tmp_path / "metrics.json").read_text())["operating_point"]["status"] == "below target"
    assert (tmp_path / "roc.png").stat().st_size > 5_000


def test_a_model_that_meets_both_takes_the_middle_of_the_thresholds_that_do(tmp_path):
    rng = np.random.default_rng(1)
    (val_p, val_y), (test_p, test_y) = scored_split(rng, 400, 0.9), scored_split(rng, 400, 0.9)
    m = evaluate(val_p, val_y, test_p, test_y, ["crack", "ok"], "ok", 0.98, tmp_path, max_false_alarm_rate=0.03)
    point = m["operating_point"]
    assert point["status"] == "meets target"
    assert point["ceiling_cut"] < m["threshold"] < point["recall_cut"]  # a margin on both sides
    assert point["val_defect_recall"] >= 0.98 and point["val_false_alarm_rate"] <= 0.03
    assert m["defect_recall"] >= 0.97 and m["false_alarm_rate"] <= 0.05
    assert point["warnings"] == []  # 200 val images a side resolve 98% and 3%


def test_a_small_val_split_is_said_to_set_the_threshold_with_a_handful_of_images(tmp_path):
    rng = np.random.default_rng(2)
    (val_p, val_y), (test_p, test_y) = scored_split(rng, 40, 0.9), scored_split(rng, 400, 0.9)
    m = evaluate(val_p, val_y, test_p, test_y, ["crack", "ok"], "ok", 0.99, tmp_path, max_false_alarm_rate=0.01)
    warnings = m["operating_point"]["warnings"]
    assert len(warnings) == 2
    n_defects = int((val_y == 0).sum())
    assert f"the val split has {n_defects} defect parts" in warnings[0] and "missing none" in warnings[0]
    assert "flagging none" in warnings[1]


def test_defect_type_sorting_has_per_class_figures_and_no_threshold(tmp_path):
    classes = ["crazing", "inclusion", "patches"]
    y = np.repeat([0, 1, 2], 20)
    probs = np.full((60, 3), 0.1)
    probs[np.arange(60), y] = 0.8
    probs[5] = [0.1, 0.8, 0.1]  # one crazing image taken for an inclusion
    m = evaluate(probs, y, probs, y, classes, None, 0.99, tmp_path)
    assert m["threshold"] is None and m["task"] == "defect-type sorting"
    assert m["accuracy"] == pytest.approx(59 / 60) and m["min_class_recall"] == pytest.approx(19 / 20)
    per_class = json.loads((tmp_path / "per_class.json").read_text())
    assert per_class["inclusion"]["precision"] == pytest.approx(20 / 21) and per_class["crazing"]["recall"] == 0.95
    for plot in ("confusion_matrix.png", "score_histogram.png", "roc.png", "precision_recall.png"):
        assert (tmp_path / plot).stat().st_size > 5_000, plot


def test_evaluate_counts_val_parts_once_when_it_knows_the_groups(tmp_path):
    classes = ["crack", "ok"]
    ok, groups = line_of_parts(100, {99: 6})  # OK parts scoring 0..0.99, the top one shot six times
    defect_scores = np.linspace(0.5, 1.0, 40)  # defects, their own parts
    val_scores = np.concatenate([ok, defect_scores])
    y_val = np.array([1] * len(ok) + [0] * len(defect_scores))
    val_groups = np.concatenate([groups, [f"d{i}" for i in range(len(defect_scores))]])
    probs = np.stack([val_scores, 1 - val_scores], axis=1)
    by_image = evaluate(probs, y_val, probs, y_val, classes, "ok", 0.98, tmp_path / "a", 0.03)
    by_part = evaluate(probs, y_val, probs, y_val, classes, "ok", 0.98, tmp_path / "b", 0.03, val_groups)
    ceiling = {name: m["operating_point"]["ceiling_cut"] for name, m in (("part", by_part), ("image", by_image))}
    assert ceiling["part"] < ceiling["image"]  # the part shot six times is one false alarm, not six
    assert by_part["defect_recall"] > by_image["defect_recall"]


def test_review_sheet_lists_the_val_images_that_set_the_cut_and_the_test_mistakes_at_the_cards_threshold(tmp_path):
    classes = ["crack", "ok"]
    rng = np.random.default_rng(0)

    def split(scores, labels, name):
        images = rng.integers(0, 255, (len(scores), 16, 16, 3), dtype=np.uint8)
        paths = [f"{classes[y]}/{name}{i}.png" for i, y in enumerate(labels)]
        return images, np.array(labels), paths, np.array(scores)

    # val: ten OK images, one of which (0.95) outscores everything, and two cracks; test: a missed crack,
    # a flagged OK image
    val = split([0.1] * 9 + [0.95, 0.9, 0.6], [1] * 10 + [0, 0], "v")
    test = split([0.2, 0.05, 0.97, 0.8, 0.3], [0, 1, 1, 0, 1], "t")
    counts = review_sheet(val, test, classes, "ok", 0.5, tmp_path, target_recall=0.98)

    assert counts == {"review_missed_defects": 1, "review_flagged_ok": 1}
    with open(tmp_path / "review.csv") as f:
        table = list(csv.DictReader(f))
    rows = [(r["split"], r["path"], r["label"], r["defect_score"]) for r in table]
    assert {(r["threshold"], r["decision"]) for r in table} == {("0.500000", "defect"), ("0.500000", "ok")}
    assert all(r["decision"] == ("defect" if float(r["defect_score"]) >= 0.5 else "ok") for r in table)
    val_rows = [r for r in rows if r[0] == "val"]
    # the val defects that set the card's threshold, lowest first, then the val OK images, highest first
    assert val_rows[:2] == [
        ("val", "crack/v11.png", "crack", "0.600000"),
        ("val", "crack/v10.png", "crack", "0.900000"),
    ]
    assert val_rows[2] == ("val", "ok/v9.png", "ok", "0.950000")  # the suspicious OK image comes first
    assert len(val_rows) == 10 and all(r[2] == "ok" for r in val_rows[2:])  # the eight highest val OK images
    # the missed defect, then the false alarm; caught defects and unflagged OK images stay out
    assert [r for r in rows if r[0] == "test"] == [
        ("test", "crack/t0.png", "crack", "0.200000"),
        ("test", "ok/t2.png", "ok", "0.970000"),
    ]
    assert {r["row"] for r in table if r["split"] == "test"} == {
        "test defects missed at the card's threshold",
        "test OK images flagged at the card's threshold",
    }
    assert Image.open(tmp_path / "review.png").size[0] > 400


def test_review_sheet_shows_each_val_part_once(tmp_path):
    classes = ["crack", "ok"]
    images = np.zeros((13, 8, 8, 3), dtype=np.uint8)
    paths = [f"ok/v{i}.png" for i in range(10)] + [f"crack/v{i}.png" for i in range(10, 13)]
    # one OK part shot six times scores highest; four other parts below it; one crack shot twice, one once
    scores = np.array([0.9, 0.91, 0.92, 0.93, 0.94, 0.95, 0.5, 0.4, 0.3, 0.2, 0.7, 0.6, 0.8])
    labels = np.array([1] * 10 + [0] * 3)
    val = (images, labels, paths, scores)
    groups = np.array(["tile"] * 6 + ["a", "b", "c", "d"] + ["crack", "crack", "e"])
    test = (images[:1], np.ones(1, dtype=np.int64), ["ok/t0.png"], np.array([0.1]))
    review_sheet(val, test, classes, "ok", 0.96, tmp_path, val_groups=groups)

    with open(tmp_path / "review.csv") as f:
        listed = [r["path"] for r in csv.DictReader(f)]
    assert listed[:2] == ["crack/v11.png", "crack/v12.png"]  # the twice-shot crack once, by its lowest shot
    assert listed[2:] == ["ok/v5.png", "ok/v6.png", "ok/v7.png", "ok/v8.png", "ok/v9.png"]  # the tile once, its top


def test_the_evaluate_stages_review_sheet_uses_the_threshold_on_the_exported_card(exported_project):
    """The one threshold: what review.csv calls missed or flagged is at the threshold the runner decides with."""
    card = json.loads((exported_project / "models/export/model.card.json").read_text())
    metrics = json.loads((exported_project / "reports/evaluate/metrics.json").read_text())
    with open(exported_project / "reports/evaluate/review.csv") as f:
        table = list(csv.DictReader(f))
    assert table and {r["threshold"] for r in table} == {f"{card['threshold']:.6f}"}
    assert card["threshold"] == metrics["threshold"]
    for r in table:
        assert r["decision"] == ("defect" if float(r["defect_score"]) >= card["threshold"] else "ok")


def held_out_with_a_look_alike(look_alike: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Held-out images of 30 OK parts (scores 0..0.29) and 30 defects (0.5..0.9); with ``look_alike``, one
    more OK part shot six times scores like a defect (0.95), as a pitted tile does. Under 33 OK parts on
    either side, so a 3% limit never lets the look-alike part be flagged on the side that sets the cut."""
    scores = [i / 100 for i in range(30)] + [0.5 + i / 75 for i in range(30)]
    groups = [f"ok{i}" for i in range(30)] + [f"d{i}" for i in range(30)]
    is_defect = [False] * 30 + [True] * 30
    if look_alike:
        scores, groups, is_defect = scores + [0.95] * 6, groups + ["pit"] * 6, is_defect + [False] * 6
    return np.array(scores), np.array(is_defect), np.array(groups)


def test_redrawn_splits_show_when_one_look_alike_ok_part_decides_the_figure_at_the_cut():
    clean = held_out_with_a_look_alike(False)
    parts = redrawn_partitions(clean[2], 0.6, 200)
    assert all(p.shape == clean[2].shape for p in parts) and 0.5 < np.mean([p.mean() for p in parts]) < 0.7
    easy = cut_on_partitions(*clean, parts, 0.03)
    assert easy["recall"] == 1.0 and easy["oracle"] == 1.0 and easy["partitions"] == 200
    pitted = held_out_with_a_look_alike(True)
    hard = cut_on_partitions(*pitted, redrawn_partitions(pitted[2], 0.6, 200), 0.03)
    # on the cut side the pit raises the cut above every defect; on the judged side its six shots break the
    # 3% limit (and take the oracle's budget): each draw is one or the other
    assert hard["recall"] < 0.7 and hard["within"] < 0.8 and hard["recall"] + hard["within"] == pytest.approx(1.0)
    assert hard["oracle"] == pytest.approx(hard["within"])
    # drawn by hand: the pit on the cut side, then on the judged side
    pit, even = pitted[2] == "pit", np.arange(len(pitted[2])) % 2 == 0
    on_cut = cut_on_partitions(*pitted, [pit | even], 0.03)
    assert on_cut["recall"] == 0.0 and on_cut["within"] == 1.0
    on_judged = cut_on_partitions(*pitted, [even & ~pit], 0.03)
    assert on_judged["recall"] == 1.0 and on_judged["within"] == 0.0 and on_judged["oracle"] == 0.0


def test_evaluate_reports_the_figures_of_redrawn_splits(tmp_path):
    classes = ["crack", "ok"]
    scores, is_defect, groups = held_out_with_a_look_alike(True)
    y = np.where(is_defect, 0, 1)
    probs = np.stack([scores, 1 - scores], axis=1)
    val = np.arange(len(y)) % 2 == 0  # the pit's shots fall on both sides: its part sets the val cut
    m = evaluate(
        probs[val], y[val], probs[~val], y[~val], classes, "ok", 0.98, tmp_path, 0.03, groups[val], groups[~val]
    )
    assert m["defect_recall"] == 0.0 and m["redrawn_splits"] == 400
    assert 0.2 < m["redrawn_defect_recall_at_ceiling"] < 0.7
    assert 0.3 < m["redrawn_within_ceiling"] < 0.8
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["redrawn_oracle_defect_recall"] == pytest.approx(m["redrawn_within_ceiling"])


def test_a_first_epoch_loss_spike_puts_the_training_curves_on_a_log_axis(tmp_path):
    spike = [22.0, 3.1, 0.9, 0.55, 0.45, 0.4, 0.35, 0.33, 0.3, 0.31, 0.28, 0.27]  # the val loss a user saw
    assert y_scale(spike) == "log"
    # a 15x spike: on a linear axis the other epochs would fill a sixth of it
    assert y_scale([4.5] + [0.3 + 0.05 * i for i in range(14)]) == "log"
    assert y_scale(list(np.linspace(2.3, 0.2, 25)) + list(np.linspace(1.8, 0.3, 25))) == "linear"  # plain decay
    assert y_scale([0.0, 0.4, 0.8, 0.9]) == "linear" and y_scale([0.5, 0.7, 0.9, 0.95]) == "linear"
    assert y_scale([float("nan"), *spike]) == "log"  # a missing epoch is no reason to give up the axis
    history = [{"epoch": i + 1, "train_loss": 1.5 / (i + 1), "val_loss": v} for i, v in enumerate(spike)]
    curves_plot(history, ["train_loss", "val_loss", "train_mask_loss"], "loss", tmp_path / "loss.png")
    assert Image.open(tmp_path / "loss.png").size == (600, 350)
