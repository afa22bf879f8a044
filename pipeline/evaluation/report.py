"""The evaluate stage's work: a trained ``model.pt`` judged on the val and test splits.

The val split picks the thresholds, the test split says how they hold (``evaluate``); the review sheet
lists the images a person should look at; the heatmaps show where the model looked. A model with tiles
is judged on its fused probabilities, each view alone beside them (``reports/evaluate/views/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import EvaluateConfig
from pipeline.data.prepare import load_groups, load_split
from pipeline.evaluation.evaluate import evaluate, review_sheet, sorting_review
from pipeline.evaluation.fusion import VIEW_KEYS, tile_view
from pipeline.evaluation.heatmaps import heatmap_report, tile_cams
from pipeline.metrics import softmax
from pipeline.model import load_model, load_tile_model, predict_logits
from pipeline.runtime import Runtime, resolve_runtime
from serving.preprocess import decode_image
from serving.tiles import fuse


@dataclass(frozen=True)
class Inputs:
    """Where the evaluate stage reads (dvc.yaml deps)."""

    model: Path = Path("models/train/model.pt")
    prepared: Path = Path("data/prepared")
    images: Path = Path("data/raw/images")
    masks: Path = Path("data/raw/masks")


@dataclass(frozen=True)
class Split:
    x: np.ndarray  # (N, S, S, C) uint8, the prepared images
    y: np.ndarray  # (N,) class indices
    paths: list[str]  # relative to Inputs.images
    groups: np.ndarray  # near-duplicate groups (one part shot several times)

    @classmethod
    def load(cls, prepared: Path, name: str) -> Split:
        x, y, paths = load_split(prepared, name)
        return cls(x, y, paths, load_groups(prepared, name))


def evaluate_model(cfg: EvaluateConfig, device: str, src: Inputs, out: Path) -> dict:
    """Every figure of the evaluate stage, written to ``out`` (metrics.json, plots, review sheet, heatmaps)."""
    net, meta = load_model(src.model)
    # Full precision, whatever training used: the threshold chosen here goes on the card of the fp32
    # export, and bf16 scores differ from it by ~1e-2 (enough to move images across the threshold).
    rt = resolve_runtime(device, "fp32")
    net = net.to(rt.device)
    val, test = Split.load(src.prepared, "val"), Split.load(src.prepared, "test")
    val_probs, test_probs = (softmax(predict_logits(net, s.x, rt)) for s in (val, test))
    tiles = load_tile_model(src.model)
    views: dict = {}
    if tiles:  # the fused probabilities decide; each view alone is judged too (reports/evaluate/views)
        val_probs, test_probs, views = fused_views(cfg, meta, tiles, (val_probs, test_probs), val, test, src, rt, out)
    metrics = judge(cfg, meta, val_probs, test_probs, val, test, out)
    if meta["ok_class"] is None:  # defect-type sorting: the images sorted wrong, the least sure ones
        metrics |= sorting_review(
            (val.x, val.y, val.paths, val_probs), (test.x, test.y, test.paths, test_probs), meta["classes"], out
        )
        if cfg.heatmaps_per_class > 0:
            metrics |= heatmaps(cfg, net, meta, None, test, test_probs, src, out)
        return metrics
    ok = meta["classes"].index(meta["ok_class"])
    metrics |= review_sheet(
        (val.x, val.y, val.paths, 1 - val_probs[:, ok]),
        (test.x, test.y, test.paths, 1 - test_probs[:, ok]),
        meta["classes"],
        meta["ok_class"],
        metrics["threshold"],  # the card's: the sheet shows what the runner would miss and flag
        out,
        val.groups,
        target_recall=metrics["target_defect_recall"],
    )
    if cfg.heatmaps_per_class > 0:
        metrics |= heatmaps(cfg, net, meta, tiles, test, test_probs, src, out)
    if views:
        metrics |= {f"{v}_{k}": m[k] for v, m in views.items() for k in VIEW_KEYS}
        metrics["tiles_weight"] = tiles[1]["weight"]
    return metrics


def judge(
    cfg: EvaluateConfig, meta: dict, val_probs: np.ndarray, test_probs: np.ndarray, val: Split, test: Split, out: Path
) -> dict:
    """``evaluate`` on these probabilities with the stage's settings."""
    return evaluate(
        val_probs,
        val.y,
        test_probs,
        test.y,
        meta["classes"],
        meta["ok_class"],
        cfg.target_defect_recall,
        out,
        cfg.max_false_alarm_rate,
        val.groups,
        test.groups,
    )


def fused_views(
    cfg: EvaluateConfig,
    meta: dict,
    tiles: tuple,
    whole: tuple[np.ndarray, np.ndarray],
    val: Split,
    test: Split,
    src: Inputs,
    rt: Runtime,
    out: Path,
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The fused val and test probabilities, and each view's own figures (written to ``out/views/<view>``)."""
    tnet, tmeta = tiles
    ok = meta["classes"].index(meta["ok_class"])
    tile_probs = tuple(
        tile_view(tnet.to(rt.device), s.paths, src.images, tmeta["tile"], meta["channels"], ok, rt) for s in (val, test)
    )
    views = {}
    for name, (pv, pt) in {"whole": whole, "tiles": tile_probs}.items():
        m = judge(cfg, meta, pv, pt, val, test, out / "views" / name)
        views[name] = {k: m[k] for k in VIEW_KEYS}
    w = tmeta["weight"]
    return fuse(whole[0], tile_probs[0], w), fuse(whole[1], tile_probs[1], w), views


def heatmaps(
    cfg: EvaluateConfig,
    net,
    meta: dict,
    tiles: tuple | None,
    test: Split,
    test_probs: np.ndarray,
    src: Inputs,
    out: Path,
) -> dict:
    """Grad-CAM heatmaps and the pointing game. A model with tiles: the tile model's heatmap over each
    photograph's most suspicious tile, the whole model's beside it (``views/whole``)."""
    common = (
        test.x,
        test.y,
        test_probs,
        test.paths,
        meta["classes"],
        meta["ok_class"],
        src.masks,
        meta["resize"],
        cfg.heatmaps_per_class,
    )
    if not tiles:
        return heatmap_report(net.float().cpu(), *common, out)
    tnet, tmeta = tiles
    ok = meta["classes"].index(meta["ok_class"])

    def photo(i: int) -> np.ndarray:
        return decode_image(src.images / test.paths[i], meta["channels"])

    cams = tile_cams(tnet.float().cpu(), photo, test.y, tmeta["tile"], ok, meta["image_size"], meta["resize"])
    whole = heatmap_report(net.float().cpu(), *common, out / "views/whole")
    return {"whole_pointing_game": whole["pointing_game"]} | heatmap_report(net.float().cpu(), *common, out, cams=cams)
