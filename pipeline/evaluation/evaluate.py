"""Evaluate: test-set metrics and the defect-vs-OK decision threshold (chosen on the val split).

The runner's decision is ``defect_score >= threshold`` with ``defect_score = 1 - p(ok)``. The
threshold never flags more than ``evaluate.max_false_alarm_rate`` of the val OK parts and catches
``evaluate.target_defect_recall`` of the val defects where that ceiling allows; where it does not, the
operating point is "below target" and the model is marked for review (``pipeline.metrics.operating_point``).
The test split then tells how that choice holds on unseen images. Without an OK class (defect-type
sorting) the most likely class decides and there is no threshold.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np

from pipeline.metrics import (
    binary_metrics,
    classification_metrics,
    cut_on_partitions,
    group_weights,
    operating_point,
    redrawn_partitions,
    roc_auc,
    small_split_warnings,
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
    ok_class: str | None,
    target_recall: float,
    out_dir: Path,
    max_false_alarm_rate: float = 0.01,
    val_groups: np.ndarray | None = None,
    test_groups: np.ndarray | None = None,
) -> dict:
    """Probabilities (N, K) of val and test -> metrics dict; writes metrics.json and plots to out_dir.

    The card's threshold (``threshold``) is chosen on the val split by ``operating_point``: never above
    ``max_false_alarm_rate`` of the val OK parts, catching ``target_recall`` of the val defect parts where
    that ceiling allows ("meets target"), else the ceiling's own cut ("below target", with the recall it
    reaches). ``operating_point`` holds that choice, its val figures and the warnings of a small val split;
    the test figures at the threshold (``defect_recall``, ``false_alarm_rate``) say how it holds on unseen
    images. ROC AUC summarizes the separation independent of any threshold. ``val_groups`` (the
    near-duplicate group of each val image): each group counts once (``group_weights``), so one part
    photographed many times does not set the cut.

    ``redrawn_*``: the val and test images pooled and split again ``REDRAWN_SPLITS`` times by group, the
    ceiling's cut picked on the val-sized side and judged on the other: the mean recall at it, the share of
    splits within the ceiling and the mean oracle (``cut_on_partitions``). On small data these say how much
    of a test figure is this split's luck.

    ``ok_class`` None (defect-type sorting): ``sorting_metrics``, no threshold.
    """
    if ok_class is None:
        return sorting_metrics(test_probs, y_test, classes, out_dir)
    ok = classes.index(ok_class)
    val_scores, val_defect = 1 - val_probs[:, ok], y_val != ok
    point = card_operating_point(val_scores, val_defect, val_groups, target_recall, max_false_alarm_rate)
    threshold = point["threshold"]
    cls, cm = classification_metrics(test_probs, y_test, classes)
    test_scores = 1 - test_probs[:, ok]
    binary = binary_metrics(test_scores, y_test != ok, threshold)
    metrics = {
        "task": "defect detection",
        "accuracy": cls["accuracy"],
        **binary,
        "threshold": threshold,
        "target_defect_recall": target_recall,
        "max_false_alarm_rate": max_false_alarm_rate,
        "operating_point": point,
        "roc_auc": roc_auc(test_scores, y_test != ok),
        "test_images": int(len(y_test)),
        "min_class_recall": min(m["recall"] for m in cls["per_class"].values() if m["support"]),
    }
    metrics |= redrawn_figures(
        (val_scores, val_defect, val_groups), (test_scores, y_test != ok, test_groups), max_false_alarm_rate
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "per_class.json").write_text(json.dumps(cls["per_class"], indent=2) + "\n")
    confusion_matrix_plot(cm, classes, f"test set, accuracy {cls['accuracy']:.3f}", out_dir / "confusion_matrix.png")
    _score_histogram(test_scores, y_test != ok, threshold, out_dir / "score_histogram.png")
    _roc_plot(
        test_scores,
        y_test != ok,
        {"card threshold": threshold, f"val {max_false_alarm_rate:.0%} ceiling": point["ceiling_cut"]},
        out_dir / "roc.png",
    )
    _pr_plot(test_scores, y_test != ok, threshold, out_dir / "precision_recall.png")
    with open(out_dir / "test_scores.csv", "w") as f:  # dvc plots: one row per test image
        f.write("label,is_defect,defect_score\n")
        for y, s in zip(y_test, test_scores, strict=True):
            f.write(f"{classes[y]},{int(y != ok)},{s:.6f}\n")
    return metrics


def card_operating_point(
    scores: np.ndarray, is_defect: np.ndarray, groups: np.ndarray | None, target_recall: float, ceiling: float
) -> dict:
    """``operating_point`` on the val split, each near-duplicate group counted once, with the number of
    parts of each kind and the warnings of a split too small to resolve the target or the ceiling."""
    w = group_weights(groups, is_defect) if groups is not None else np.ones(len(is_defect))
    point = operating_point(scores, is_defect, target_recall, ceiling, w)
    point["val_defect_parts"] = int(round(w[is_defect].sum()))
    point["val_ok_parts"] = int(round(w[~is_defect].sum()))
    point["warnings"] = small_split_warnings(point["val_defect_parts"], point["val_ok_parts"], target_recall, ceiling)
    if point["status"] != "meets target":
        log.warning(
            "operating point below target: at the %.1f%% false-alarm ceiling the model catches %.1f%% of the val "
            "defects, not %.1f%%; the card marks it for review (not deployable by default)",
            100 * ceiling,
            100 * point["val_defect_recall"],
            100 * target_recall,
        )
    return point


def redrawn_figures(val: tuple, test: tuple, ceiling: float) -> dict:
    """``redrawn_*``: val and test ((scores, is_defect, groups or None) each) pooled and split again by group,
    the ceiling's cut picked on the val-sized side and judged on the other (``cut_on_partitions``)."""
    (val_scores, val_defect, val_groups), (test_scores, test_defect, test_groups) = val, test
    n_val, n_test = len(val_scores), len(test_scores)
    groups = np.concatenate(
        [  # without groups every image is its own part
            val_groups if val_groups is not None else np.array([f"val{i}" for i in range(n_val)]),
            test_groups if test_groups is not None else np.array([f"test{i}" for i in range(n_test)]),
        ]
    )
    pooled = np.concatenate([val_scores, test_scores])
    pooled_defect = np.concatenate([val_defect, test_defect])
    partitions = redrawn_partitions(groups, n_val / (n_val + n_test), REDRAWN_SPLITS)
    redrawn = cut_on_partitions(pooled, pooled_defect, groups, partitions, ceiling, val_groups is not None)
    if not redrawn["partitions"]:
        return {"redrawn_splits": 0}
    return {
        "redrawn_splits": redrawn["partitions"],
        "redrawn_defect_recall_at_ceiling": redrawn["recall"],
        "redrawn_within_ceiling": redrawn["within"],
        "redrawn_oracle_defect_recall": redrawn["oracle"],
    }


def sorting_metrics(test_probs: np.ndarray, y_test: np.ndarray, classes: list[str], out_dir: Path) -> dict:
    """Defect-type sorting (no OK class): the most likely class decides, no threshold. Accuracy, each
    class's precision and recall (per_class.json), the worst class's recall (``min_class_recall``, what
    promotion compares first) and the confusion matrix."""
    cls, cm = classification_metrics(test_probs, y_test, classes)
    recalls = [m["recall"] for m in cls["per_class"].values() if m["support"]]
    metrics = {
        "task": "defect-type sorting",
        "accuracy": cls["accuracy"],
        "min_class_recall": min(recalls),
        "macro_recall": float(np.mean(recalls)),
        "threshold": None,
        "test_images": int(len(y_test)),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out_dir / "per_class.json").write_text(json.dumps(cls["per_class"], indent=2) + "\n")
    confusion_matrix_plot(cm, classes, f"test set, accuracy {cls['accuracy']:.3f}", out_dir / "confusion_matrix.png")
    pred, top = test_probs.argmax(axis=1), test_probs.max(axis=1)
    _confidence_histogram(top, pred == y_test, out_dir / "score_histogram.png")
    _one_vs_rest_roc(test_probs, y_test, classes, out_dir / "roc.png")
    _per_class_bars(cls["per_class"], out_dir / "precision_recall.png")
    with open(out_dir / "test_scores.csv", "w") as f:  # one row per test image
        f.write("label,predicted,probability\n")
        for y, k, p in zip(y_test, pred, top, strict=True):
            f.write(f"{classes[y]},{classes[k]},{p:.6f}\n")
    return metrics


def _confidence_histogram(top: np.ndarray, correct: np.ndarray, path: Path) -> None:
    """Sorting: the most likely class's probability, right and wrong test images apart."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = np.linspace(0, 1, 41)
    ax.hist(top[correct], bins=bins, alpha=0.6, label="sorted right")
    ax.hist(top[~correct], bins=bins, alpha=0.6, label="sorted wrong")
    ax.set_yscale("log")
    ax.set_xlabel("probability of the most likely class")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _one_vs_rest_roc(probs: np.ndarray, labels: np.ndarray, classes: list[str], path: Path) -> None:
    """Sorting: each class against the others, its probability as the score."""
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for k, name in enumerate(classes):
        scores, positive = probs[:, k], labels == k
        if not positive.any() or positive.all():
            continue
        cuts = np.r_[np.inf, np.sort(np.unique(scores))[::-1]]
        fpr = [(scores[~positive] >= t).mean() for t in cuts]
        tpr = [(scores[positive] >= t).mean() for t in cuts]
        ax.plot(fpr, tpr, label=f"{name}, AUC {roc_auc(scores, positive):.3f}")
    ax.set(xlabel="other classes' images taken for it", ylabel="its images found", xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _per_class_bars(per_class: dict, path: Path) -> None:
    """Sorting: each class's precision and recall on the test split."""
    names = list(per_class)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(names)), 3.5))
    for k, key in enumerate(("precision", "recall")):
        bars = ax.bar(x + (k - 0.5) * 0.38, [per_class[n][key] for n in names], 0.38, label=key)
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.set_xticks(x, names, rotation=20, fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("test split, per class")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


def sorting_review(val: tuple, test: tuple, classes: list[str], out_dir: Path, per_row: int = 8) -> dict:
    """Defect-type sorting's review sheet (review.csv, review.png): the test images sorted into the wrong
    class (surest first: a wrong label or a look-alike class) and the val images the model is least sure
    of. ``val`` and ``test``: (images, labels, paths, probabilities (N, K))."""
    (xv, yv, pv, probs_v), (xt, yt, pt, probs_t) = val, test
    conf_v, conf_t = probs_v.max(axis=1), probs_t.max(axis=1)
    wrong = np.nonzero(probs_t.argmax(axis=1) != yt)[0]
    wrong = wrong[np.argsort(-conf_t[wrong], kind="stable")][:per_row].tolist()
    unsure = np.argsort(conf_v, kind="stable")[:per_row].tolist()
    rows = {
        "test images sorted into another class (surest first: check the label)": ("test", (xt, yt, pt, conf_t), wrong),
        "val images the model is least sure of": ("val", (xv, yv, pv, conf_v), unsure),
    }
    with open(out_dir / "review.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["row", "split", "path", "label", "predicted", "probability"])
        for name, (split, (_, y, paths, _), idx) in rows.items():
            probs = probs_t if split == "test" else probs_v
            for i in idx:
                k = int(probs[i].argmax())
                out.writerow([name, split, paths[i], classes[y[i]], classes[k], f"{probs[i, k]:.6f}"])
    review_grid(
        rows,
        classes,
        "defect-type sorting: label and the most likely class's probability",
        per_row,
        out_dir / "review.png",
    )
    n_wrong = int((probs_t.argmax(axis=1) != yt).sum())
    return {"review_sorted_wrong": n_wrong}


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
    if m["threshold"] is None:
        note = (
            f"Defect-type sorting, test split, {m['test_images']} images: accuracy {m['accuracy']:.3f}, "
            f"worst class recall {m['min_class_recall']:.3f}."
        )
    else:
        p = m["operating_point"]
        note = (
            f"Test split, {m['test_images']} images: accuracy {m['accuracy']:.3f}, defect recall "
            f"{m['defect_recall']:.3f} and false-alarm rate {m['false_alarm_rate']:.3f} at the card's threshold "
            f"{m['threshold']:.3f} ({p['status']}: on val {p['val_defect_recall']:.3f} recall at "
            f"{p['val_false_alarm_rate']:.3f} false alarms); ROC AUC {m['roc_auc']:.3f}."
        )
        run.log_metrics({k: p[k] for k in ("val_defect_recall", "val_false_alarm_rate")})
    run.set_tags({"mlflow.note.content": note})
