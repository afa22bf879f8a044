"""Evaluate: test-set metrics and the defect-vs-OK decision threshold (chosen on the val split).

The runner's decision is ``defect_score >= threshold`` with ``defect_score = 1 - p(ok)``. The
threshold is the highest one that still catches ``evaluate.target_defect_recall`` of the defects in
the validation split; the test split then tells how that choice holds on unseen images.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np

from pipeline.metrics import (
    binary_metrics,
    choose_threshold,
    classification_metrics,
    cut_on_partitions,
    group_weights,
    redrawn_partitions,
    roc_auc,
    threshold_for_false_alarms,
)
from pipeline.plots import confusion_matrix_plot, plt

log = logging.getLogger(__name__)

REDRAWN_SPLITS = 400  # re-drawn val/test partitions for the split-luck figures


def evaluate(
    val_probs: np.ndarray,
    y_val: np.ndarray,
    test_probs: np.ndarray,
    y_test: np.ndarray,
    classes: list[str],
    ok_class: str,
    target_recall: float,
    out_dir: Path,
    max_false_alarm_rate: float = 0.03,
    val_groups: np.ndarray | None = None,
    test_groups: np.ndarray | None = None,
) -> dict:
    """Probabilities (N, K) of val and test -> metrics dict; writes metrics.json and plots to out_dir.

    Two operating points, both chosen on the val split and measured on test: ``threshold`` catches
    ``target_recall`` of val defects (the one the model card uses), ``far_threshold`` flags at most
    ``max_false_alarm_rate`` of val OK images (how many defects does a line that tolerates that many
    false alarms catch?). ROC AUC summarizes the separation independent of any threshold.
    ``val_groups`` (the near-duplicate group of each val image): recall and false-alarm rate on val
    count each group once (``group_weights``), so one part photographed many times does not set the cut.

    ``redrawn_*``: the val and test images pooled and split again ``REDRAWN_SPLITS`` times by group, the
    cut picked on the val-sized side as ``far_threshold`` is and judged on the other: the mean recall at
    it, the share of splits within the false-alarm limit and the mean oracle (``cut_on_partitions``). On
    small data these say how much of the test figure at ``far_threshold`` is this split's luck.
    """
    ok = classes.index(ok_class)
    val_scores, val_defect = 1 - val_probs[:, ok], y_val != ok
    w = None if val_groups is None else group_weights(val_groups, val_defect)
    threshold = choose_threshold(val_scores, val_defect, target_recall, w)
    far_threshold = threshold_for_false_alarms(
        val_scores[~val_defect], max_false_alarm_rate, None if w is None else w[~val_defect]
    )
    cls, cm = classification_metrics(test_probs, y_test, classes)
    test_scores = 1 - test_probs[:, ok]
    binary = binary_metrics(test_scores, y_test != ok, threshold)
    at_far = binary_metrics(test_scores, y_test != ok, far_threshold)
    metrics = {
        "accuracy": cls["accuracy"],
        **binary,
        "threshold": threshold,
        "target_defect_recall": target_recall,
        "roc_auc": roc_auc(test_scores, y_test != ok),
        "far_threshold": far_threshold,
        "defect_recall_at_far_threshold": at_far["defect_recall"],
        "false_alarm_rate_at_far_threshold": at_far["false_alarm_rate"],
        "test_images": int(len(y_test)),
    }
    n_val, n_test = len(y_val), len(y_test)
    groups = np.concatenate(
        [  # without groups every image is its own part
            val_groups if val_groups is not None else np.array([f"val{i}" for i in range(n_val)]),
            test_groups if test_groups is not None else np.array([f"test{i}" for i in range(n_test)]),
        ]
    )
    pooled = np.concatenate([val_scores, test_scores])
    pooled_defect = np.concatenate([val_defect, y_test != ok])
    partitions = redrawn_partitions(groups, n_val / (n_val + n_test), REDRAWN_SPLITS)
    redrawn = cut_on_partitions(pooled, pooled_defect, groups, partitions, max_false_alarm_rate, val_groups is not None)
    metrics["redrawn_splits"] = redrawn["partitions"]
    if redrawn["partitions"]:
        metrics["redrawn_defect_recall_at_far_threshold"] = redrawn["recall"]
        metrics["redrawn_within_false_alarm_limit"] = redrawn["within"]
        metrics["redrawn_oracle_defect_recall"] = redrawn["oracle"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "per_class.json").write_text(json.dumps(cls["per_class"], indent=2) + "\n")
    confusion_matrix_plot(cm, classes, f"test set, accuracy {cls['accuracy']:.3f}", out_dir / "confusion_matrix.png")
    _score_histogram(test_scores, y_test != ok, threshold, out_dir / "score_histogram.png")
    _roc_plot(
        test_scores, y_test != ok, {"val recall target": threshold, "val FAR limit": far_threshold}, out_dir / "roc.png"
    )
    _pr_plot(test_scores, y_test != ok, threshold, out_dir / "precision_recall.png")
    with open(out_dir / "test_scores.csv", "w") as f:  # dvc plots: one row per test image
        f.write("label,is_defect,defect_score\n")
        for y, s in zip(y_test, test_scores, strict=True):
            f.write(f"{classes[y]},{int(y != ok)},{s:.6f}\n")
    return metrics


Split = tuple[np.ndarray, np.ndarray, list[str], np.ndarray]  # images, labels, paths, defect scores


def highest_shot_per_part(keep: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """``keep`` narrowed to each near-duplicate group's highest-scoring image (one shot per part)."""
    keep, seen = keep.copy(), set()
    for i in np.argsort(-scores, kind="stable"):
        if keep[i]:
            keep[i] = groups[i] not in seen
            seen.add(groups[i])
    return keep


def review_sheet(
    val: Split,
    test: Split,
    classes: list[str],
    ok_class: str,
    threshold: float,
    out_dir: Path,
    val_groups: np.ndarray | None = None,
    per_row: int = 8,
    target_recall: float | None = None,
) -> dict:
    """The images a person should look at first, at the model card's threshold: review.csv and review.png.

    ``threshold`` is the card's (``evaluate``'s ``threshold``: the highest that catches ``target_recall`` of
    the val defects), the one the runner decides with, so what the sheet calls missed or flagged is what
    the runner would miss or flag; review.csv names it on every row (``threshold``, ``decision``) and
    review.png in its title. Four rows: the val defect parts that score lowest (they set the threshold: a
    defect label on an image that shows none pulls it down, and every OK part pays in false alarms), the
    val OK parts that score highest (an OK label on an image that shows a defect teaches the model to pass
    it), the test defects missed at the threshold (lowest score first) and the test OK images it flags
    (highest first). With ``val_groups`` each val part appears once, by its lowest (defects) or highest
    (OK) shot. Returns how many test defects it misses and test OK images it flags.
    """
    ok = classes.index(ok_class)
    val_defect, val_ok = val[1] != ok, val[1] == ok
    if val_groups is not None:
        val_defect = highest_shot_per_part(val_defect, -val[3], val_groups)
        val_ok = highest_shot_per_part(val_ok, val[3], val_groups)
    missed = (test[1] != ok) & (test[3] < threshold)
    flagged = (test[1] == ok) & (test[3] >= threshold)

    def first(keep: np.ndarray, scores: np.ndarray, highest: bool) -> list[int]:
        order = np.argsort(-scores if highest else scores, kind="stable")
        return [int(i) for i in order if keep[i]][:per_row]

    rows = {
        "val defect parts, lowest scores (check their labels: they set the card's threshold)": (
            "val",
            val,
            first(val_defect, val[3], highest=False),
        ),
        "val OK parts, highest scores (check their labels: a defect labeled OK is learned as OK)": (
            "val",
            val,
            first(val_ok, val[3], highest=True),
        ),
        "test defects missed at the card's threshold": ("test", test, first(missed, test[3], highest=False)),
        "test OK images flagged at the card's threshold": ("test", test, first(flagged, test[3], highest=True)),
    }
    with open(out_dir / "review.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["row", "split", "path", "label", "defect_score", "threshold", "decision"])
        for name, (split, (_, y, paths, scores), idx) in rows.items():
            for i in idx:
                decision = "defect" if scores[i] >= threshold else "ok"
                out.writerow([name, split, paths[i], classes[y[i]], f"{scores[i]:.6f}", f"{threshold:.6f}", decision])
    how = f", chosen on val to catch {target_recall:.0%} of defects" if target_recall is not None else ""
    title = f"defect score = 1 - p(ok); the model card's threshold is {threshold:.3f}{how} (defect at or above it)"
    review_grid(rows, classes, title, per_row, out_dir / "review.png")
    return {"review_missed_defects": int(missed.sum()), "review_flagged_ok": int(flagged.sum())}


def review_grid(rows: dict, classes: list[str], title: str, per_row: int, path: Path) -> None:
    """One row of images per entry of ``rows``: {title: (split name, (images, labels, paths, scores), indices)},
    each image captioned with its label, defect score and file name, under the sheet's ``title``."""
    fig = plt.figure(figsize=(1.5 * per_row, 2.2 * len(rows)), layout="constrained")
    fig.suptitle(title, fontsize=9)
    for sub, (name, (_, (x, y, paths, scores), idx)) in zip(fig.subfigures(len(rows), 1), rows.items(), strict=True):
        sub.suptitle(name if len(idx) else f"{name}: none", fontsize=8)
        for c, ax in enumerate(sub.subplots(1, per_row)):
            ax.axis("off")
            if c < len(idx):
                img = x[idx[c]]
                ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=255)
                ax.set_title(f"{classes[y[idx[c]]]} {scores[idx[c]]:.3f}\n{Path(paths[idx[c]]).name[:20]}", fontsize=6)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _score_histogram(scores: np.ndarray, is_defect: np.ndarray, threshold: float, path: Path) -> None:
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


def _roc_plot(scores: np.ndarray, is_defect: np.ndarray, points: dict[str, float], path: Path) -> None:
    """ROC curve of the test split with the operating points of the val-chosen thresholds."""
    cuts = np.r_[np.inf, np.sort(np.unique(scores))[::-1]]
    far = [binary_metrics(scores, is_defect, t)["false_alarm_rate"] for t in cuts]
    rec = [binary_metrics(scores, is_defect, t)["defect_recall"] for t in cuts]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot(far, rec, label=f"test ROC, AUC {roc_auc(scores, is_defect):.3f}")
    for (name, t), marker in zip(points.items(), "os", strict=False):
        m = binary_metrics(scores, is_defect, t)
        ax.plot(m["false_alarm_rate"], m["defect_recall"], marker, label=f"{name}: t={t:.3f}")
    ax.set(xlabel="false-alarm rate (OK images flagged)", ylabel="defect recall", xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pr_plot(scores: np.ndarray, is_defect: np.ndarray, threshold: float, path: Path) -> None:
    """Precision-recall of the defect class on the test split, with the model card's threshold marked."""
    cuts = np.sort(np.unique(scores))[::-1]
    flagged = scores[None, :] >= cuts[:, None]
    tp = (flagged & is_defect[None, :]).sum(axis=1)
    precision = tp / np.maximum(flagged.sum(axis=1), 1)
    recall = tp / max(int(is_defect.sum()), 1)
    at = scores >= threshold
    p_at = (at & is_defect).sum() / max(int(at.sum()), 1)
    r_at = (at & is_defect).sum() / max(int(is_defect.sum()), 1)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot(recall, precision, label="test split")
    ax.plot(r_at, p_at, "o", label=f"card threshold {threshold:.3f}")
    ax.axhline(is_defect.mean(), color="gray", linestyle=":", label=f"chance ({is_defect.mean():.2f})")
    ax.set(xlabel="defect recall", ylabel="precision (flagged images that are defects)", xlim=(0, 1.02), ylim=(0, 1.02))
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_to_mlflow(run, metrics: dict, out_dir: Path) -> None:
    """Into the model's run: every test figure as ``test_<name>`` (per class ``test_recall_<class>``), the
    reports and plots under ``evaluate/``, and the headline figures as the run's description (the tag
    ``mlflow.note.content``, the first thing its page shows)."""
    run.log_metrics({f"test_{k}": v for k, v in metrics.items() if isinstance(v, float) and np.isfinite(v)})
    per_class = json.loads((out_dir / "per_class.json").read_text())
    run.log_metrics({f"test_recall_{c}": m["recall"] for c, m in per_class.items()})
    run.log_artifacts(out_dir, "evaluate")
    m = metrics
    run.set_tags(
        {
            "mlflow.note.content": f"Test split, {m['test_images']} images: accuracy {m['accuracy']:.3f}, defect "
            f"recall {m['defect_recall']:.3f} and false-alarm rate {m['false_alarm_rate']:.3f} at the threshold "
            f"{m['threshold']:.3f}; ROC AUC {m['roc_auc']:.3f}."
        }
    )
