"""Small matplotlib helpers: every plot a person would rather look at than read, as a PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # headless: stages run without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def bar_chart(values: dict[str, float], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(values) + 2), 3.2))
    bars = ax.bar(list(values), list(values.values()), color="#4c72b0")
    ax.bar_label(bars)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def confusion_matrix_plot(cm: np.ndarray, classes: list[str], title: str, path: Path) -> None:
    """cm: (K, K) counts, rows = true class, columns = predicted class."""
    fig, ax = plt.subplots(figsize=(1.0 * len(classes) + 2.5, 1.0 * len(classes) + 2))
    norm = cm / np.maximum(cm.sum(axis=1, keepdims=True), 1)
    ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    for i in range(len(classes)):
        for j in range(len(classes)):
            ax.text(j, i, str(int(cm[i, j])), ha="center", va="center", color="white" if norm[i, j] > 0.5 else "black")
    ax.set_xticks(range(len(classes)), classes, rotation=45, ha="right")
    ax.set_yticks(range(len(classes)), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class PlainLogFormatter(matplotlib.ticker.LogFormatter):
    """Log-axis tick labels as plain numbers (0.4, not 4 x 10^-1) on the ticks matplotlib would label
    (minor ticks only where the axis spans few decades, so they never overlap)."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def y_scale(values: list[float]) -> str:
    """The y scale that keeps curves readable: log where a linear axis would flatten them. Only for positive
    values (losses), when their span is over 20x (a loss falling from 1.3 to 0.05) or the middle 80% of them
    would fill under a quarter of a linear axis (one spike, like a first-epoch val loss of 22 over epochs
    near 0.3, puts every other epoch on the floor)."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if len(v) < 2 or v.min() <= 0:
        return "linear"
    low, high = np.percentile(v, [10, 90])
    squeezed = high - low < 0.25 * (v.max() - v.min())
    return "log" if v.max() / v.min() > 20 or squeezed else "linear"


def curves_plot(history: list[dict], keys: list[str], title: str, path: Path) -> None:
    """One line per key over epochs; ``history`` rows are the per-epoch dicts of the train stage."""
    members_curves_plot([history], keys, title, path)


def members_curves_plot(
    histories: list[list[dict]], keys: list[str], title: str, path: Path, final: dict[str, float] | None = None
) -> None:
    """The curves of several runs in one plot (an ensemble's members): a colour per key, a line style per
    run; ``final`` values (the ensemble's own) are drawn as thick pale horizontal lines in the key's colour."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    styles = ["-", "--", ":", "-."]
    if y_scale([row[k] for h in histories for row in h for k in keys if k in row]) == "log":
        ax.set_yscale("log")  # one early spike (a val loss of 22 in epoch 1) would flatten every other epoch
        ax.set_ylabel("log scale")
        ax.yaxis.set_major_formatter(PlainLogFormatter())
        ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
    for i, k in enumerate(keys):
        if not all(history and k in history[0] for history in histories):
            continue  # a figure this run does not record (train_mask_loss without masks)
        colour = f"C{i}"
        for m, history in enumerate(histories):
            label = k if len(histories) == 1 else f"{k}, member {m}"
            epochs = [row["epoch"] for row in history]
            ax.plot(
                epochs,
                [row[k] for row in history],
                styles[m % len(styles)],
                color=colour,
                marker="o",
                markersize=3 if len(histories) > 1 else None,
                label=label,
            )
        if final and k in final:
            ax.axhline(final[k], color=colour, linewidth=2.5, alpha=0.5, label=f"{k}, ensemble")
    ax.set_xlabel("epoch")
    ax.legend(fontsize=7 if len(histories) > 1 else None)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def image_grid(
    rows: list[list[np.ndarray]], row_titles: list[str], path: Path, col_titles: list[str] | None = None
) -> None:
    """Rows of (H, W, C) uint8 images in a grid with a title per row."""
    n_rows, n_cols = len(rows), max(len(r) for r in rows)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(1.6 * n_cols, 1.7 * n_rows), squeeze=False)
    for i, row in enumerate(rows):
        for j in range(n_cols):
            ax = axes[i][j]
            ax.axis("off")
            if j < len(row):
                img = row[j]
                ax.imshow(img[:, :, 0] if img.shape[2] == 1 else img, cmap="gray", vmin=0, vmax=255)
            if i == 0 and col_titles and j < len(col_titles):
                ax.set_title(col_titles[j], fontsize=8)
        axes[i][0].text(-0.08, 0.5, row_titles[i], transform=axes[i][0].transAxes, ha="right", va="center", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def variants_plot(report: dict, path: Path) -> None:
    """Export variants side by side: accuracy and defect recall (left), batch-1 latency (right)."""
    names = list(report)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    x = np.arange(len(names))
    second = (
        ("defect_recall", "defect recall")
        if "defect_recall" in report["fp32"]
        else ("min_class_recall", "worst class recall")
    )
    for k, (key, label) in enumerate([("accuracy", "accuracy"), second]):
        bars = left.bar(x + (k - 0.5) * 0.38, [report[n][key] for n in names], 0.38, label=label)
        left.bar_label(bars, fmt="%.3f", fontsize=7)
    left.set_xticks(x, names)
    left.set_ylim(0, 1.1)
    left.legend(loc="lower right", fontsize=8)
    left.set_title("test set, at the card's threshold")
    bars = right.bar(names, [report[n]["latency"]["batch_1_p50_ms"] for n in names], color="#dd8452")
    right.bar_label(bars, fmt="%.1f ms", fontsize=8)
    right.set_title("batch-1 latency p50 (this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def benchmark_plot(report: dict, path: Path) -> None:
    """The benchmark stage's figure: batch-1 latency per contender (p50, bar to p99), and images/s end to
    end and over HTTP against the 116 img/s a 10-million-images-a-day line needs."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    b1 = report["batch_1"]
    names = list(b1)
    spread = [[0] * len(names), [b1[n]["p99_ms"] - b1[n]["p50_ms"] for n in names]]
    axes[0].bar(names, [b1[n]["p50_ms"] for n in names], yerr=spread)
    axes[0].set(title="batch 1 latency (p50, bar to p99)", ylabel="ms")
    e2e = report["end_to_end"]
    labels = [f"{v} {fmt.split('_')[0]}" for v in e2e for fmt in e2e[v]]
    values = [e2e[v][fmt] for v in e2e for fmt in e2e[v]]
    http = report["http"]
    labels += [f"HTTP c={http['concurrency']} tensors", f"HTTP c={http['concurrency']} images"]
    values += [http["infer_img_s"], http["classify_img_s"]]
    axes[1].barh(labels, values)
    axes[1].axvline(116, color="red", linestyle="--", label="116 img/s = 10 M images/day")
    axes[1].set(title="images/s end to end (decode, resize, infer)", xlabel="img/s")
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
