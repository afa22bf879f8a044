"""How well does a recipe rank the whole dataset, not one split? Out-of-fold scores of every labeled image.

    python experiments/crossfit.py --folds 4 [--params sweeps/<name>/<lever>/seed0/params.yaml]

Run it in a project whose prepare stage has run (``data/prepared``). The train and val splits are pooled
and dealt into ``--folds`` folds by near-duplicate group (one part's shots stay together; each class's
parts dealt largest first to the fold holding the fewest of that class). Then one model per fold, trained
by the train stage's own code with the params given (``train.ensemble`` 1, ``train.seed`` + fold) on every
pooled image outside its fold, scores the images of its fold: every train and val image gets a score
from a model that never saw it. On small data that is a figure of the recipe, not of one lucky or
unlucky split:

- ``oof_auc``: defect vs OK over all pooled images; ``oof_recall_at_far``: the recall at the cut that flags
  ``--max-false-alarm-rate`` of the pooled OK parts (each near-duplicate group weighs one, as the evaluate
  stage counts val parts), with the false alarms it flags by images;
- the test split scored by each fold's model and by their mean (an ensemble of the folds' models, every
  labeled image but the test split's seen by some of them): test AUC, the test recall at the
  out-of-fold cut and the test split's own oracle. A test AUC far above ``oof_auc`` says the test split is
  easier than the data as a whole;
- by defect class: each class's out-of-fold AUC against the OK images and the share the cut catches;
- by the original image's longer side (quarters of the pooled images, from the validate stage's
  ``manifest.csv``): out-of-fold AUC, recall and false alarms at the cut. Where the large images score far
  worse than the small ones, the downscale to ``prepare.image_size`` is a suspect; on the magnetic tiles
  the photographs of 496-632 px rank at AUC 0.60-0.73 for every recipe measured, those below at 0.77-0.99;
- the review sheet: the OK parts that score highest out of fold (one shot each) and the defects that score
  lowest, from the whole dataset, with their paths in ``review.csv``: the labels to check first.

Writes ``report.md``, ``metrics.json``, ``review.png``, ``review.csv`` and ``oof.npz`` (every
probability, for mixing) to ``--out`` (default ``models/crossfit``), each fold's data, model and
checkpoints under ``fold-k`` (a killed run resumes the fold it was in), and logs a run ``crossfit`` to the
project's MLflow store (the folds' trainings are runs of their own). Cost: ``--folds`` trainings, each on
(folds - 1) / folds of the train and val images.

``--combine DIR DIR ...`` trains nothing: it averages the out-of-fold probabilities of earlier runs on the
same folds (recipes that differ, e.g. the members of an ensemble; runs at another ``prepare.image_size``
too, their images checked by path) and reports that ensemble the same way; the test split is then scored
by the mean of all their models.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from pathlib import Path

import numpy as np

from pipeline.config import apply_changes, load_params, params_from_dict
from pipeline.metrics import binary_metrics, group_weights, roc_auc, softmax, threshold_for_false_alarms
from pipeline.prepare import read_summary


def group_folds(labels: np.ndarray, groups: np.ndarray, folds: int, seed: int = 0) -> np.ndarray:
    """Fold index of each image: every near-duplicate group in one fold; per class its groups dealt largest
    first (ties in random order) to the fold that holds the fewest images of that class so far."""
    rng = np.random.default_rng(seed)
    fold = np.full(len(labels), -1)
    for c in np.unique(labels):
        names, sizes = np.unique(groups[labels == c], return_counts=True)
        order = rng.permutation(len(names))
        held = np.zeros(folds)
        for i in sorted(order, key=lambda j: -sizes[j]):
            part = (groups == names[i]) & (fold < 0)  # a part shot under two labels: placed with its first
            f = int(np.argmin(held + rng.random(folds) * 1e-6))
            fold[part] = f
            held[f] += part.sum()
    return fold


def pool(prepared: Path) -> dict[str, np.ndarray]:
    """The train and val splits' arrays (images, labels, paths, groups, masks) end to end."""
    with np.load(prepared / "train.npz") as tr, np.load(prepared / "val.npz") as va:
        return {k: np.concatenate([tr[k], va[k]]) for k in tr.files}


def write_fold(prepared: Path, pooled: dict, held_out: np.ndarray, dest: Path) -> Path:
    """A prepared folder for one fold: train = pooled minus the fold, val = the fold, test unchanged. Written
    once: the same fold again keeps its files (their bytes are in the training's fingerprint, so a killed
    run resumes instead of starting over)."""
    marker = dest / "fold.json"
    held_paths = json.dumps(sorted(str(p) for p in pooled["paths"][held_out]))
    if marker.is_file() and marker.read_text() == held_paths:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    info = read_summary(prepared)
    for name, keep in (("train", ~held_out), ("val", held_out)):
        np.savez(dest / f"{name}.npz", **{k: v[keep] for k, v in pooled.items()})
        labels = pooled["labels"][keep]
        info["splits"][name] = {c: int((labels == i).sum()) for i, c in enumerate(info["classes"])}
    (dest / "test.npz").write_bytes((prepared / "test.npz").read_bytes())
    (dest / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    marker.write_text(held_paths)
    return dest


def fold_cuts(fold: np.ndarray, groups: np.ndarray, ok: np.ndarray, oof: np.ndarray, test_probs: list[np.ndarray],
              ok_index: int, far: float, test_defect: np.ndarray) -> list[dict]:  # fmt: skip
    """The pipeline's operating point, once per fold: fold k's models (with ``--combine`` the mean of every
    run's fold-k model; ``test_probs`` is run after run, fold after fold) judged on the test split at the cut
    flagging ``far`` of fold k's OK parts, the images they never saw, as the evaluate stage cuts on the val
    split. Folds draws of the val cut with training sets of (folds - 1) / folds of the pooled images; NaN for
    a fold without OK images."""
    folds = int(fold.max()) + 1
    runs = len(test_probs) // folds
    out = []
    for k in range(folds):
        held_ok = (fold == k) & ok
        if not held_ok.any():  # tiny data: no OK part to set this fold's cut; the other figures still stand
            out.append({"defect_recall": float("nan"), "false_alarm_rate": float("nan")})
            continue
        cut = threshold_for_false_alarms(oof[held_ok], far, group_weights(groups[held_ok]))
        probs = np.mean([test_probs[r * folds + k] for r in range(runs)], 0)
        out.append(binary_metrics(1 - probs[:, ok_index], test_defect, cut))
    return out


def by_size(sides: np.ndarray, oof: np.ndarray, is_defect: np.ndarray, cut: float, bins: int = 4) -> list[dict]:
    """Out-of-fold figures of the images in each quarter (``bins``) of the original longer side: a recipe that
    loses small defects in the downscale ranks the large images worse. [] when every image has one size."""
    edges = np.unique(np.quantile(sides, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:
        return []
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        inside = (sides >= lo) & ((sides <= hi) if i == len(edges) - 2 else (sides < hi))
        at_cut = binary_metrics(oof[inside], is_defect[inside], cut)
        rows.append({
            "longer_side": [int(lo), int(hi)],
            "images": int(inside.sum()),
            "defects": int(is_defect[inside].sum()),
            "auc": roc_auc(oof[inside], is_defect[inside]),
            "recall_at_cut": at_cut["defect_recall"],
            "false_alarms_at_cut": at_cut["false_alarm_rate"],
        })  # fmt: skip
    return rows


def by_class(labels: np.ndarray, ok_index: int, classes: list[str], oof: np.ndarray, cut: float) -> list[dict]:
    """Out-of-fold figures of each defect class: its images against every OK image (AUC) and the share of them
    the cut catches. A class far below the others is the kind of defect the recipe does not see."""
    ok = labels == ok_index
    rows = []
    for c, name in enumerate(classes):
        mine = labels == c
        if c == ok_index or not mine.any():
            continue
        judged = mine | ok
        rows.append({
            "class": name,
            "images": int(mine.sum()),
            "auc_against_ok": roc_auc(oof[judged], mine[judged]),
            "recall_at_cut": binary_metrics(oof[judged], mine[judged], cut)["defect_recall"],
        })  # fmt: skip
    return rows


def longer_sides(manifest: Path, paths: np.ndarray) -> np.ndarray | None:
    """Each image's original longer side in pixels from the validate stage's manifest; None without one (or
    with one that does not list every image)."""
    from pipeline.validate import read_manifest

    if not manifest.is_file():
        return None
    side = {r["path"]: max(int(r["width"]), int(r["height"])) for r in read_manifest(manifest)}
    missing = [str(p) for p in paths if str(p) not in side]
    if missing:  # reported after the trainings: warn and leave the breakdown out rather than lose the run
        logging.warning("--manifest %s: %d pooled images not listed (first: %s), the manifest of another dataset? "
                        "No figures by image size", manifest, len(missing), missing[0])  # fmt: skip
        return None
    return np.array([side[str(p)] for p in paths])


def score(model_file: Path, images: list[np.ndarray], precision: str) -> list[np.ndarray]:
    from pipeline.loop import predict_logits
    from pipeline.runtime import resolve_runtime
    from pipeline.train import load_model

    rt = resolve_runtime("cpu", precision)
    model, _ = load_model(model_file)
    model = model.to(rt.device).eval()
    return [softmax(predict_logits(model, x, rt)) for x in images]


def review_sheet(pooled: dict, oof: np.ndarray, ok: np.ndarray, classes: list[str], cut: float, out: Path) -> None:
    """The highest-scoring OK parts (one shot each) and the lowest-scoring defects, out of fold."""
    from pipeline.evaluate import highest_shot_per_part, review_grid

    data = (pooled["images"], pooled["labels"], [str(p) for p in pooled["paths"]], oof)
    keep = highest_shot_per_part(ok, oof, pooled["groups"])
    top = [int(i) for i in np.argsort(-oof, kind="stable") if keep[i]][:8]
    low = [int(i) for i in np.argsort(oof, kind="stable") if not ok[i]][:8]
    rows = {"OK parts scored highest out of fold (check their labels)": ("pool", data, top),
            "defects scored lowest out of fold": ("pool", data, low)}  # fmt: skip
    review_grid(rows, classes, cut, 8, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="the recipe (a params.yaml)")
    ap.add_argument("--prepared", type=Path, default=Path("data/prepared"))
    ap.add_argument("--max-false-alarm-rate", type=float, default=0.03)
    ap.add_argument("--manifest", type=Path, default=Path("data/validated/manifest.csv"),
                    help="the validate stage's manifest: original image sizes for the figures by size")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("models/crossfit"))
    ap.add_argument("--combine", type=Path, nargs="+", metavar="DIR",
                    help="no training: the mean of earlier runs' out-of-fold scores (their --out folders, the "
                         "same folds), an ensemble of their recipes judged out of fold")  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s crossfit %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "mlflow.store", "urllib3", "matplotlib", "PIL", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.folds < 2:
        raise SystemExit(f"--folds {args.folds}: at least 2 folds are needed (each model holds one out)")

    import yaml

    info = read_summary(args.prepared)
    pooled = pool(args.prepared)
    with np.load(args.prepared / "test.npz") as z:
        x_test, y_test = z["images"], z["labels"]
    raw = yaml.safe_load(args.params.read_text())
    if args.combine:
        fold, oof_probs, test_probs = combine(args.combine, pooled)
        source = " + ".join(map(str, args.combine))
    else:
        fold, oof_probs, test_probs = crossfit(args, raw, info, pooled, x_test)
        source = str(args.params)
        np.savez(args.out / "oof.npz", paths=pooled["paths"].astype(str), fold=fold, probs=oof_probs,
                 test_probs=np.array(test_probs))  # fmt: skip
    metrics = report(args, info, pooled, fold, oof_probs, test_probs, y_test, source)
    log_to_mlflow(raw["mlflow"], args, source, metrics)
    return 0


def crossfit(args: argparse.Namespace, raw: dict, info: dict, pooled: dict, x_test: np.ndarray) -> tuple:
    """Train one model per fold; (fold of each pooled image, out-of-fold probabilities, test probabilities
    of each fold's model)."""
    from pipeline.train import train

    raw = apply_changes(raw, {"train.ensemble": 1, "train.ensemble_members": []}, str(args.params))
    if raw["prepare"]["image_size"] != info["image_size"]:
        raise SystemExit(f"{args.params}: prepare.image_size is {raw['prepare']['image_size']}, but "
                         f"{args.prepared} holds {info['image_size']} px images; run `dvc repro prepare` "
                         f"with these params first")  # fmt: skip
    load_params(args.params)  # every key checked, with the message naming a wrong one
    fold = group_folds(pooled["labels"], pooled["groups"], args.folds, raw["data"]["seed"])
    oof_probs = np.zeros((len(fold), len(info["classes"])), np.float32)
    test_probs = []
    for k in range(args.folds):
        held = fold == k
        where = args.out / f"fold-{k}"
        prepared = write_fold(args.prepared, pooled, held, where / "prepared")
        params = params_from_dict(apply_changes(raw, {"train.seed": raw["train"]["seed"] + k}, f"fold {k}"))
        logging.info("fold %d of %d: %d images held out, training on %d", k + 1, args.folds, held.sum(), (~held).sum())
        train(params, prepared, where / "model", where / "reports")
        oof_probs[held], p_test = score(
            where / "model/model.pt", [pooled["images"][held], x_test], params.train.precision
        )
        test_probs.append(p_test)
    return fold, oof_probs, test_probs


def combine(runs: list[Path], pooled: dict) -> tuple:
    """Earlier runs' ``oof.npz`` on the same images and folds -> the mean of their out-of-fold probabilities,
    and every one of their models' test probabilities."""
    fold, probs, test_probs = None, [], []
    for run in runs:
        if not (run / "oof.npz").is_file():
            raise SystemExit(f"--combine {run}: no oof.npz there (an experiments/crossfit.py --out folder)")
        with np.load(run / "oof.npz") as z:
            if list(z["paths"]) != [str(p) for p in pooled["paths"]]:
                raise SystemExit(f"--combine {run}: scored other images than the train and val splits here")
            if fold is not None and not np.array_equal(z["fold"], fold):
                raise SystemExit(f"--combine {run}: other folds than {runs[0]} (another --folds or data.seed)")
            fold = z["fold"]
            probs.append(z["probs"])
            test_probs += list(z["test_probs"])
    return fold, np.mean(probs, 0), test_probs


def report(args, info, pooled, fold, oof_probs, test_probs, y_test, source) -> dict:  # fmt: skip
    """metrics.json, review.csv, review.png and report.md in ``args.out``; the metrics."""
    labels, groups = pooled["labels"], pooled["groups"]
    ok_index = info["classes"].index(info["ok_class"])
    oof = 1 - oof_probs[:, ok_index]
    folds = int(fold.max()) + 1
    far = args.max_false_alarm_rate
    ok, t_ok = labels == ok_index, y_test == ok_index
    w = group_weights(groups, ~ok)
    cut = threshold_for_false_alarms(oof[ok], far, w[ok])
    pooled_at_cut = binary_metrics(oof, ~ok, cut)
    test_scores = [1 - p[:, ok_index] for p in test_probs]
    mean_probs = np.mean(test_probs, 0)
    ens = 1 - mean_probs[:, ok_index]
    at_cut = binary_metrics(ens, ~t_ok, cut)
    oracle = binary_metrics(ens, ~t_ok, threshold_for_false_alarms(ens[t_ok], far))
    held_cuts = fold_cuts(fold, groups, ok, oof, test_probs, ok_index, far, ~t_ok)
    n_train = sum(info["splits"]["train"].values())
    metrics = {
        "folds": folds,
        "oof_auc": roc_auc(oof, ~ok),
        "oof_auc_by_fold": [roc_auc(oof[fold == k], ~ok[fold == k]) for k in range(folds)],
        "oof_auc_train_split": roc_auc(oof[:n_train], ~ok[:n_train]),
        "oof_auc_val_split": roc_auc(oof[n_train:], ~ok[n_train:]),
        "oof_accuracy": float((oof_probs.argmax(1) == labels).mean()),
        "oof_cut": cut,
        "oof_recall_at_far": pooled_at_cut["defect_recall"],
        "oof_false_alarms_by_images": pooled_at_cut["false_alarm_rate"],
        "test_auc_by_model": [roc_auc(s, ~t_ok) for s in test_scores],
        "test_auc": roc_auc(ens, ~t_ok),
        "test_recall_at_oof_cut": at_cut["defect_recall"],
        "test_false_alarms_at_oof_cut": at_cut["false_alarm_rate"],
        "test_oracle_recall": oracle["defect_recall"],
        "test_accuracy": float((mean_probs.argmax(1) == y_test).mean()),
        "test_recall_at_fold_cuts": [r["defect_recall"] for r in held_cuts],
        "test_false_alarms_at_fold_cuts": [r["false_alarm_rate"] for r in held_cuts],
        "test_recall_at_fold_cuts_mean": float(np.nanmean([r["defect_recall"] for r in held_cuts])),
        "test_within_at_fold_cuts": int(sum(r["false_alarm_rate"] <= far for r in held_cuts)),
    }
    sides = longer_sides(args.manifest, pooled["paths"])
    metrics["oof_by_longer_side"] = [] if sides is None else by_size(sides, oof, ~ok, cut)
    metrics["oof_by_class"] = by_class(labels, ok_index, info["classes"], oof, cut)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with open(args.out / "review.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["path", "label", "group", "fold", "oof_defect_score"])
        for i in sorted(range(len(labels)), key=lambda i: (labels[i] != ok_index, -oof[i] if ok[i] else oof[i])):
            out.writerow([pooled["paths"][i], info["classes"][labels[i]], groups[i], fold[i], f"{oof[i]:.6f}"])
    review_sheet(pooled, oof, ok, info["classes"], cut, args.out / "review.png")
    pct = f"{far:.0%}"
    table = "\n".join([
        f"| figure ({folds} folds of {len(labels)} train and val images; {source}) | value |",
        "|---|---|",
        f"| out-of-fold AUC, all / train split / val split / by fold | {metrics['oof_auc']:.3f} / "
        f"{metrics['oof_auc_train_split']:.3f} / {metrics['oof_auc_val_split']:.3f} / "
        + ", ".join(f"{a:.3f}" for a in metrics["oof_auc_by_fold"]) + " |",
        f"| out-of-fold recall at the cut flagging {pct} of OK parts (false alarms by images) | "
        f"{metrics['oof_recall_at_far']:.2f} ({metrics['oof_false_alarms_by_images']:.2f}) |",
        f"| out-of-fold 6-class accuracy | {metrics['oof_accuracy']:.2f} |",
        "| test AUC, each model / their mean | " + ", ".join(f"{a:.3f}" for a in metrics["test_auc_by_model"])
        + f" / {metrics['test_auc']:.3f} |",
        f"| test recall at the out-of-fold cut (test false alarms) / oracle | {metrics['test_recall_at_oof_cut']:.2f} "
        f"({metrics['test_false_alarms_at_oof_cut']:.2f}) / {metrics['test_oracle_recall']:.2f} |",
        f"| test 6-class accuracy, the mean | {metrics['test_accuracy']:.2f} |",
        "| test recall at each fold's own cut (its held-out OK parts, as the evaluate stage's val cut; test false "
        "alarms), by fold / mean, within the budget | " + ", ".join(
            f"{r:.2f} ({f:.2f})" for r, f in zip(metrics["test_recall_at_fold_cuts"],
                                                 metrics["test_false_alarms_at_fold_cuts"], strict=True))
        + f" / {metrics['test_recall_at_fold_cuts_mean']:.2f}, {metrics['test_within_at_fold_cuts']} of {folds} |",
    ]) + "\n"  # fmt: skip
    table += "\n| defect class | images | out-of-fold AUC against the OK images | recall at the cut |\n"
    table += "|---|---|---|---|\n"
    for r in metrics["oof_by_class"]:
        table += f"| {r['class']} | {r['images']} | {r['auc_against_ok']:.3f} | {r['recall_at_cut']:.2f} |\n"
    if metrics["oof_by_longer_side"]:
        table += "\n| original longer side (px) | images (defects) | out-of-fold AUC | recall at the cut "
        table += "(false alarms) |\n|---|---|---|---|\n"
        for r in metrics["oof_by_longer_side"]:
            lo, hi = r["longer_side"]
            table += (f"| {lo}-{hi} | {r['images']} ({r['defects']}) | {r['auc']:.3f} | "
                      f"{r['recall_at_cut']:.2f} ({r['false_alarms_at_cut']:.2f}) |\n")  # fmt: skip
    (args.out / "report.md").write_text(table)
    print(table)
    return metrics


def log_to_mlflow(mlflow_params: dict, args: argparse.Namespace, source: str, metrics: dict) -> None:
    from pipeline import tracking
    from pipeline.config import MlflowConfig

    try:
        with tracking.open_run(MlflowConfig(**mlflow_params), run_name="crossfit") as run:
            run.log_params({"folds": metrics["folds"], "source": source})
            values = {k: v for k, v in metrics.items() if isinstance(v, float | int)}
            values |= {f"oof_auc_longer_side_q{i + 1}": r["auc"] for i, r in enumerate(metrics["oof_by_longer_side"])}
            values |= {f"oof_auc_class_{r['class']}": r["auc_against_ok"] for r in metrics["oof_by_class"]}
            values |= {f"oof_recall_class_{r['class']}": r["recall_at_cut"] for r in metrics["oof_by_class"]}
            run.log_metrics({k: v for k, v in values.items() if np.isfinite(v)})
            run.log_artifacts(args.out / "report.md", "crossfit")
            run.log_artifacts(args.out / "review.png", "crossfit")
            run.log_artifacts(args.out / "review.csv", "crossfit")
            print(f"MLflow run {run.run_id} (crossfit)", file=sys.stderr)
    except tracking.TrackingUnavailable as exc:
        print(f"not logged to MLflow ({exc}); the report is in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
