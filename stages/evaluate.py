"""Stage evaluate: test metrics, the val-chosen threshold, plots and Grad-CAM heatmaps, logged to the
model's MLflow run."""

import json
from pathlib import Path

from pipeline import tracking
from pipeline.entry import run_stage
from pipeline.evaluate import evaluate, log_to_mlflow, review_sheet
from pipeline.heatmaps import heatmap_report, tile_cams
from pipeline.metrics import softmax
from pipeline.prepare import load_groups, load_split
from pipeline.runtime import resolve_runtime
from pipeline.tiles import tile_view
from pipeline.train import load_model, load_tile_model, predict_logits
from serving.preprocess import decode_image
from serving.tiles import fuse

VIEW_KEYS = ("defect_recall_at_far_threshold", "false_alarm_rate_at_far_threshold", "roc_auc", "accuracy")


def main(params):
    net, meta = load_model(Path("models/train/model.pt"))
    # Full precision, whatever training used: the threshold chosen here goes on the card of the fp32
    # export, and bf16 scores differ from it by ~1e-2 (enough to move images across the threshold).
    rt = resolve_runtime(params.train.device, "fp32")
    net = net.to(rt.device)
    x_val, y_val, val_paths = load_split(Path("data/prepared"), "val")
    x_test, y_test, test_paths = load_split(Path("data/prepared"), "test")
    val_probs, test_probs = (softmax(predict_logits(net, x, rt)) for x in (x_val, x_test))
    out = Path("reports/evaluate")
    val_groups = load_groups(Path("data/prepared"), "val")
    views = {}
    tiles = load_tile_model(Path("models/train/model.pt"))
    if tiles:  # the fused probabilities decide; each view alone is judged too (reports/evaluate/views)
        tnet, tmeta = tiles
        ok = meta["classes"].index(meta["ok_class"])
        tile_probs = [tile_view(tnet.to(rt.device), paths, Path("data/raw/images"), tmeta["tile"], meta["channels"],
                                ok, rt) for paths in (val_paths, test_paths)]  # fmt: skip
        for name, (pv, pt) in {"whole": (val_probs, test_probs), "tiles": tile_probs}.items():
            m = evaluate(pv, y_val, pt, y_test, meta["classes"], meta["ok_class"], params.evaluate.target_defect_recall,
                         out / "views" / name, params.evaluate.max_false_alarm_rate, val_groups,
                         load_groups(Path("data/prepared"), "test"))  # fmt: skip
            views[name] = {k: m[k] for k in VIEW_KEYS}
        val_probs, test_probs = fuse(val_probs, tile_probs[0], tmeta["weight"]), fuse(test_probs, tile_probs[1],
                                                                                      tmeta["weight"])  # fmt: skip
    metrics = evaluate(
        val_probs,
        y_val,
        test_probs,
        y_test,
        meta["classes"],
        meta["ok_class"],
        params.evaluate.target_defect_recall,
        out,
        params.evaluate.max_false_alarm_rate,
        val_groups,
        load_groups(Path("data/prepared"), "test"),
    )
    ok = meta["classes"].index(meta["ok_class"])
    metrics |= review_sheet(
        (x_val, y_val, val_paths, 1 - val_probs[:, ok]),
        (x_test, y_test, test_paths, 1 - test_probs[:, ok]),
        meta["classes"],
        meta["ok_class"],
        metrics["far_threshold"],
        out,
        val_groups,
    )
    if params.evaluate.heatmaps_per_class > 0:
        masks, hp = Path("data/raw/masks"), params.evaluate.heatmaps_per_class
        common = (x_test, y_test, test_probs, test_paths, meta["classes"], meta["ok_class"], masks, meta["resize"], hp)
        cams = None
        if tiles:  # the tile model's heatmap over each photograph's most suspicious tile; the whole model's beside

            def photo(i: int):
                return decode_image(Path("data/raw/images") / test_paths[i], meta["channels"])

            cams = tile_cams(tnet.float().cpu(), photo, y_test, tmeta["tile"], ok, meta["image_size"], meta["resize"])
            whole = heatmap_report(net.float().cpu(), *common, out / "views/whole")
            metrics["whole_pointing_game"] = whole["pointing_game"]
        metrics |= heatmap_report(net.float().cpu(), *common, out, cams=cams)
    if views:
        metrics |= {f"{v}_{k}": m[k] for v, m in views.items() for k in VIEW_KEYS}
        metrics["tiles_weight"] = tiles[1]["weight"]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with tracking.resume_run(params.mlflow, Path("models/train/run.json"), stage="evaluate") as run:
        log_to_mlflow(run, metrics, out)
    print(f"evaluate: {metrics}")


if __name__ == "__main__":
    run_stage("evaluate", main)
