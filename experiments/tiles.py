"""Does a model that sees the photographs at their own resolution help the pipeline's model? Measured on the
real split, at the evaluate stage's own operating points.

    python experiments/tiles.py [--with models/train/model.pt [MODEL ...]] [--model resnet10t] [--epochs 28]
                                [--ok-share 0.3] [--scale 1]

The pipeline itself now trains such a tile model wherever the data has masks (params.yaml, ``tiles``;
measured: docs/magnetic_tiles.md, *The tile model in the pipeline*); this tool measures other tile recipes
beside a whole-image model. Run it in a project whose train stage has run on data with defect masks
(``<source>_masks``, which the ingest stage copies to ``data/raw/masks``). Every image of the train, val and
test splits is cut into square tiles of ``prepare.image_size`` (``--tile``) at 1:1, no downscale (tiles
overlap just enough to cover the edges; a side shorter than a tile is padded), so a defect 2 px wide stays 2
px wide, where the prepare stage's downscale of a 600 px photograph to 128 px leaves it under half a pixel.
``--scale 0.5`` first shrinks each photograph and its mask to half their sides (the prepare stage's bilinear
resize; a mask cell stays marked where any defect pixel falls in it; ``--min-mask-pixels`` counts the resized
pixels), so a 2 px defect is still 1 px wide: fewer tiles (the magnetic tiles' test split: 3.1 per image
instead of 8.2, an epoch 0.44x), but there it caught less on re-drawn splits than 1:1 at half the epochs for
the same time (measured: docs/magnetic_tiles.md).

- Training tiles are labeled by the masks: a defect of its image's class where the mask covers at least
  ``--min-mask-pixels`` of the tile, OK where it covers none (every tile of an OK image, the clean tiles of
  a defect image); tiles in between, and every tile of a defect image without a mask, are left out.
- One model (the params' recipe, ``train.ensemble`` 1, with ``--model``'s network: resnet10t, which trains
  at 1.4x the default network's images/s, and on the magnetic tiles ranked the val tiles better in 28 epochs
  than the default network did in 40; measured: docs/magnetic_tiles.md) learns them with the train stage's
  own code for ``--epochs``, a fresh ``--ok-share`` of the OK tiles drawn each epoch
  (``train.majority_per_epoch``), at a peak learning rate of ``--lr`` 0.001, a third of the whole images'
  0.003: at 0.003 the magnetic tiles' model called every tile OK for 20 epochs or more (one seed in three
  never left that plateau), at 0.001 it left by epoch 9 and ranked the test images better (measured:
  docs/magnetic_tiles.md).
- An image's probabilities are those of its tile with the highest defect score.
- Three views of the val and test splits go through the evaluate stage's own function (the cut flagging
  ``evaluate.max_false_alarm_rate`` of the val OK parts, judged on test; AUC; 6-class accuracy; the
  re-drawn splits; ROC and histogram plots): the pipeline's model (``--with``), the tiles, and the mean of
  the two's probabilities (the tiles weighing as much as the whole ensemble: on the magnetic tiles that
  weight was measured best, 0.88 against 0.87 for the tiles as a fourth equal member, out of fold). Each
  further ``--with`` model (an ensemble's member: ``models/train/checkpoints/member-0/model.pt``) adds its
  own two views, ``whole-2`` and ``fused-2``, then ``-3``..., against the same tile model.

Writes ``report.md``, ``metrics.json``, ``scores.npz`` (every probability) and one evaluate folder per view
(``whole/``, ``tiles/``, ``fused/``, then ``whole-2/``, ``fused-2/``...) to ``--out`` (default
``models/tiles``), the tile data, model and checkpoints under it (a killed run resumes), and logs a run
``tiles`` to the project's MLflow store.
Cost: one training on about 8x the pixels of the whole images (the magnetic tiles: 8.6 tiles per train image;
28 resnet10t epochs with 30% of the OK tiles took 13 minutes on 2 CPU cores, 2.5x a 25-epoch whole-image
training). A dataset without masks stops here with a message: the tiles' labels would have to be learned
from the image's label.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from pipeline.config import apply_changes, load_params, params_from_dict
from pipeline.prepare import read_summary
from pipeline.tiles import KEYS, fit_check, tile_split, write_tile_data
from serving.preprocess import resize_bilinear
from serving.tiles import image_probs


def rescale(image: np.ndarray, mask: np.ndarray | None, scale: float) -> tuple[np.ndarray, np.ndarray | None]:
    """``image`` (H, W, C uint8) and its ``mask`` (H, W bool) resized by ``scale`` (sides rounded, at least
    1 px): the image bilinear like the prepare stage's resize (``serving.preprocess.resize_bilinear``), each
    mask pixel marking the cell it falls in, so a 1 px defect is never thinned away (a resampling filter can
    drop an edge row or column where a side is odd). ``scale`` 1 returns both as they are."""
    if scale == 1:
        return image, mask
    h, w = image.shape[:2]
    h2, w2 = max(1, round(h * scale)), max(1, round(w * scale))
    small = resize_bilinear(image, w2, h2)
    if mask is None:
        return small, None
    ys, xs = np.nonzero(mask)
    cells = np.zeros((h2, w2), bool)
    cells[ys * h2 // h, xs * w2 // w] = True
    return small, cells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the recipe (a params.yaml)")
    ap.add_argument("--prepared", type=Path, default=Path("data/prepared"))
    ap.add_argument("--raw", type=Path, default=Path("data/raw"), help="the ingest stage's images/ and masks/")
    ap.add_argument("--with", dest="whole", type=Path, nargs="+", default=[Path("models/train/model.pt")],
                    help="the pipeline's model (and any others), each fused with the tiles")  # fmt: skip
    ap.add_argument("--tile", type=int, default=0, help="tile side in px; 0 = prepare.image_size")
    ap.add_argument("--model", default="resnet10t", help="the tile model's timm network (its model.name)")
    ap.add_argument("--epochs", type=int, default=28)
    ap.add_argument("--ok-share", type=float, default=0.3, help="share of the OK tiles drawn each epoch")
    ap.add_argument("--lr", type=float, default=0.001, help="the tile model's peak train.lr (see the docstring)")
    ap.add_argument("--min-mask-pixels", type=int, default=16, help="in the (resized) tile's pixels")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="resize each photograph and its mask by this factor before cutting them")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None, help="the tile model's train.seed (default: the params')")
    ap.add_argument("--out", type=Path, default=Path("models/tiles"))
    args = ap.parse_args(argv)
    if not 0 < args.scale <= 1:
        ap.error(f"--scale {args.scale}: expected a factor in (0, 1]; 1 cuts the photographs at 1:1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tiles %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "mlflow.store", "urllib3", "matplotlib", "PIL", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import yaml

    from experiments.crossfit import score
    from pipeline.evaluate import evaluate
    from pipeline.train import train

    load_params(args.params)  # every key checked, with the message naming a wrong one
    raw = yaml.safe_load(args.params.read_text())
    info = read_summary(args.prepared)
    classes, ok_index = info["classes"], info["classes"].index(info["ok_class"])
    tile = args.tile or raw["prepare"]["image_size"]
    at = "1:1" if args.scale == 1 else f"scale {args.scale:g}"
    for path in args.whole:
        if not path.is_file():
            raise SystemExit(f"--with {path}: no such model; run `dvc repro train` first")
    if not any((args.raw / "masks").rglob("*.png")):
        raise SystemExit(f"{args.raw / 'masks'}: no defect masks; the tiles' training labels come from masks (a "
                         f"folder <source>_masks beside data.source, <class>/<stem>.png per defect image)")  # fmt: skip
    splits = {}
    for name in ("train", "val", "test"):
        with np.load(args.prepared / f"{name}.npz") as z:
            splits[name] = {k: z[k] for k in KEYS}

    def scaled(image, mask):
        return rescale(image, mask, args.scale)

    tiles = {name: tile_split(d, args.raw / "images", args.raw / "masks", tile, raw["data"]["channels"], ok_index,
                              args.min_mask_pixels, scaled, f"tiles {name}") for name, d in splits.items()}  # fmt: skip
    tr = tiles["train"]["labels"]
    logging.info("%d px tiles at %s: train %d (%d defect, %d OK, %d left out), val %d, test %d", tile, at,
                 len(tr), int(((tr >= 0) & (tr != ok_index)).sum()), int((tr == ok_index).sum()),
                 int((tr < 0).sum()), len(tiles["val"]["labels"]), len(tiles["test"]["labels"]))  # fmt: skip
    if not ((tr >= 0) & (tr != ok_index)).any():
        raise SystemExit(f"{args.raw / 'masks'}: no training tile is covered by a defect mask "
                         f"(>= {args.min_mask_pixels} px); nothing to learn defects from")  # fmt: skip
    recipe = apply_changes(raw, {"model.name": args.model, "train.ensemble": 1, "train.ensemble_members": [],
                                 "train.epochs": args.epochs,
                                 "train.majority_per_epoch": args.ok_share, "prepare.image_size": tile,
                                 "train.lr": args.lr, "train.mask_loss": 0.0,
                                 "train.seed": raw["train"]["seed"] if args.seed is None else args.seed},
                           "tiles")  # fmt: skip
    params = params_from_dict(recipe)
    scaled = {} if args.scale == 1 else {"tile_scale": args.scale}  # a 1:1 run of before --scale still resumes
    data = write_tile_data(args.out / "prepared", dict(info, image_size=tile, **scaled), tiles["train"], tiles["val"])
    train(params, data, args.out / "model", args.out / "reports")
    fit = fit_check(args.out / "reports/history.csv", tr, ok_index, args.ok_share)

    per_tile = score(args.out / "model/model.pt", [tiles["val"]["images"], tiles["test"]["images"]],
                     params.train.precision)  # fmt: skip
    p_tiles = [image_probs(p, tiles[s]["parent"], len(splits[s]["labels"]), ok_index)
               for p, s in zip(per_tile, ("val", "test"), strict=True)]  # fmt: skip
    suffixes = [f"-{i + 1}" if i else "" for i in range(len(args.whole))]  # whole, whole-2, ... per --with model
    views = {}
    for i, (path, suffix) in enumerate(zip(args.whole, suffixes, strict=True)):  # whole, tiles, fused, whole-2, ...
        views[f"whole{suffix}"] = score(path, [splits["val"]["images"], splits["test"]["images"]],
                                        params.train.precision)  # fmt: skip
        if not i:
            views["tiles"] = p_tiles
        views[f"fused{suffix}"] = [(a + b) / 2 for a, b in zip(views[f"whole{suffix}"], p_tiles, strict=True)]
    np.savez(
        args.out / "scores.npz",
        **{f"{v}_{s}": p for v, (pv, pt) in views.items() for s, p in (("val", pv), ("test", pt))},
    )
    ev = raw["evaluate"]
    metrics = {"tile": tile, "scale": args.scale,
               "tiles_per_image": len(tiles["test"]["labels"]) / len(splits["test"]["labels"]),
               "model": params.model.name, "epochs": params.train.epochs, "seed": params.train.seed,
               "lr": params.train.lr, **fit}  # fmt: skip
    for view, (pv, pt) in views.items():
        m = evaluate(pv, splits["val"]["labels"], pt, splits["test"]["labels"], classes, info["ok_class"],
                     ev["target_defect_recall"], args.out / view, ev["max_false_alarm_rate"],
                     splits["val"]["groups"], splits["test"]["groups"])  # fmt: skip
        metrics[view] = m
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    far = f"{ev['max_false_alarm_rate']:.0%}"
    wholes = "; ".join(f"whole{suffix}: {path}" for suffix, path in zip(suffixes, args.whole, strict=True))
    lines = [f"| view ({tile} px tiles at {at}, {metrics['tiles_per_image']:.1f} per image; {wholes}) | "
             f"test recall at the val {far} cut (test false alarms) | test AUC | 6-class accuracy | "
             f"re-drawn splits: recall, within {far} |", "|---|---|---|---|---|"]  # fmt: skip
    for view in views:
        m, nan = metrics[view], float("nan")
        lines.append(f"| {view} | {m['defect_recall_at_far_threshold']:.2f} "
                     f"({m['false_alarm_rate_at_far_threshold']:.2f}) | {m['roc_auc']:.3f} | {m['accuracy']:.2f} | "
                     f"{m.get('redrawn_defect_recall_at_far_threshold', nan):.2f}, "
                     f"{m.get('redrawn_within_false_alarm_limit', nan):.2f} |")  # fmt: skip
    lines.append(f"\nThe tile model ({metrics['model']}, epochs: {metrics['epochs']}) at its last epoch: train "
                 f"accuracy {fit['tile_train_accuracy']:.2f} (OK tiles {fit['epoch_ok_share']:.2f} of an epoch), "
                 f"val tiles' AUC {fit['tile_val_auc']:.3f}"
                 + ("" if fit["tile_model_fit"] else "; **it did not fit**"))  # fmt: skip
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log_to_mlflow(raw["mlflow"], args, metrics, list(views))
    return 0


def log_to_mlflow(mlflow_params: dict, args: argparse.Namespace, metrics: dict, views: list[str]) -> None:
    from pipeline import tracking
    from pipeline.config import MlflowConfig

    keys = ("defect_recall_at_far_threshold", "false_alarm_rate_at_far_threshold", "roc_auc", "accuracy")
    try:
        with tracking.open_run(MlflowConfig(**mlflow_params), run_name="tiles") as run:
            run.log_params({"tile": metrics["tile"], "scale": args.scale, "with": " ".join(map(str, args.whole)),
                            "model": metrics["model"], "epochs": args.epochs, "seed": metrics["seed"],
                            "ok_share": args.ok_share, "lr": args.lr,
                            "min_mask_pixels": args.min_mask_pixels})  # fmt: skip
            run.log_metrics({f"{v}_{k}": float(metrics[v][k]) for v in views for k in keys})
            run.log_metrics({k: float(metrics[k]) for k in ("tile_train_accuracy", "tile_val_auc", "tile_model_fit")})
            run.log_artifacts(args.out / "report.md", "tiles")
            for v in views:
                run.log_artifacts(args.out / v / "roc.png", f"tiles/{v}")
            print(f"MLflow run {run.run_id} (tiles)", file=sys.stderr)
    except tracking.TrackingUnavailable as exc:
        print(f"not logged to MLflow ({exc}); the report is in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
