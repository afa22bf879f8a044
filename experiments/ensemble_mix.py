"""Which members should an ensemble have? Measured post hoc on the models a `defect sweep` trained.

    python experiments/ensemble_mix.py sweeps/magnetic-tiles sweeps/magnetic-tiles-orientation \
        --mix "default:3" --mix "default:2,gamma only:1" --mix "default:1,gamma only:2"

Every finished run of the sweep folders is a trained model, kept in MLflow (its ``result.json`` names
the run). A mix ``A:2,B:1`` is every ensemble of two runs of lever A and one of lever B, no seed used
twice in a lever. Each ensemble scores the mean of its members' class probabilities on the val and test
splits of ``data/prepared`` (what ``train.ensemble`` computes), and its threshold is chosen on val as the
evaluate stage chooses it (each near-duplicate group weighing one). Per mix the table gives: how many
ensembles, their mean and lowest defect recall at the val 3% threshold, how many keep the test false
alarms within the budget counted by images (the goal's figure) and by parts, test AUC, the oracle (the
recall at the threshold flagging 3% of the test OK images: the ranking alone) and class accuracy.
``--val-count images`` weighs every val OK image one in the cut instead (the goal counts test false
alarms by images). Then the ensembles ``train.ensemble_members`` would train in that order for
``train.seed`` s (member k with seed s + k), one row per s the sweep has every run for.

Run it in the project the sweep ran in, after the sweep: ``data/prepared`` is then the sweep's data.
Members trained at another ``prepare.image_size`` (a lever of input geometry) are scored on the same images
prepared at their size: ``--prepared-at 128=../other/data/prepared`` (a project whose prepare stage ran at
128 px on the same data and split; checked image by image), so ensembles can mix input sizes.
``--redraw N`` also scores each ensemble on N re-drawn partitions of the held-out parts (val and test pooled,
each near-duplicate group drawn to the cut side with the val split's share of the images): the mean recall at
the cut, the share of draws within the budget and the oracle, i.e. how much of a figure is this split's luck.
The table is written to ``<first sweep folder>/ensemble_mix.md`` (or ``--out``) and logged, with each
mix's figures as metrics, to an MLflow run ``ensemble mix`` in the sweep's experiment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import numpy as np
import yaml

from pipeline.metrics import (
    binary_metrics,
    cut_on_partitions,
    group_weights,
    redrawn_partitions,
    roc_auc,
    softmax,
    threshold_for_false_alarms,
)
from pipeline.prepare import load_groups, load_split, read_summary


def parse_mix(text: str) -> list[tuple[str, int]]:
    mix = []
    for part in text.split(","):
        lever, _, count = part.rpartition(":")
        if not lever or not count.strip().isdigit() or int(count) < 1:
            raise SystemExit(f"--mix {text!r}: expected LEVER:COUNT[,LEVER:COUNT...], e.g. 'default:2,gamma only:1'")
        mix.append((lever.strip(), int(count)))
    return mix


def finished_runs(folders: list[Path]) -> dict[tuple[str, int], dict]:
    """(lever, seed) -> the run's result.json, with its folder and its params.yaml (raw: older runs may
    lack keys params.yaml has now), over every sweep folder given."""
    runs = {}
    for folder in folders:
        for result in sorted(folder.glob("*/seed*/result.json")):
            r = json.loads(result.read_text())
            if r.get("rc") == 0 and r.get("mlflow_run_id"):
                used = yaml.safe_load((result.parent / "params.yaml").read_text())
                runs[(r["lever"], int(r["seed"]))] = {**r, "dir": result.parent, "params": used}
    if not runs:
        raise SystemExit(f"no finished sweep runs under {', '.join(map(str, folders))}")
    return runs


def score_runs(runs: dict, needed: list, prepared: Path | dict[int, Path]) -> dict:
    """(lever, seed) -> (val probabilities, test probabilities) of the run's model, from MLflow. ``prepared``:
    the splits, or {image size: splits} where members differ in ``prepare.image_size``."""
    import mlflow

    from pipeline.loop import predict_logits
    from pipeline.runtime import resolve_runtime
    from pipeline.train import load_model

    at = prepared if isinstance(prepared, dict) else None
    splits: dict[Path, tuple[np.ndarray, np.ndarray]] = {}
    probs = {}
    for key in needed:
        run = runs[key]
        used = run["params"]
        where = at[used["prepare"]["image_size"]] if at else prepared
        if where not in splits:
            splits[where] = (load_split(where, "val")[0], load_split(where, "test")[0])
        x_val, x_test = splits[where]
        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", used["mlflow"]["tracking_uri"]))
        path = mlflow.artifacts.download_artifacts(run_id=run["mlflow_run_id"], artifact_path="model/model.pt")
        model, _ = load_model(Path(path))
        rt = resolve_runtime("cpu", used["train"]["precision"])
        model = model.to(rt.device).eval()
        probs[key] = tuple(softmax(predict_logits(model, x, rt)) for x in (x_val, x_test))
        print(f"scored {key[0]}, seed {key[1]}", file=sys.stderr, flush=True)
    return probs


def sizes_prepared(prepared: Path, extra: list[str]) -> dict[int, Path]:
    """``SIZE=DIR`` options -> {size: DIR}, each DIR holding the very images of ``prepared``'s val and test
    splits (same files, same order, same labels) at that size."""
    out = {}
    for text in extra:
        size, sep, folder = text.partition("=")
        if not sep or not size.strip().isdigit():
            raise SystemExit(f"--prepared-at {text!r}: expected SIZE=DIR, e.g. 128=../other/data/prepared")
        where, size = Path(folder), int(size)
        found = read_summary(where)["image_size"]
        if found != size:
            raise SystemExit(f"--prepared-at {text!r}: {where} holds {found} px images, not {size}")
        for split in ("val", "test"):
            _, y, paths = load_split(where, split)
            _, y_ref, paths_ref = load_split(prepared, split)
            if paths != paths_ref or not np.array_equal(y, y_ref):
                raise SystemExit(f"--prepared-at {text!r}: its {split} split holds other images or labels than "
                                 f"{prepared}'s; prepare the same data with the same split params")  # fmt: skip
        out[size] = where
    return out


class Judge:
    """An ensemble's figures, computed as the evaluate stage computes them."""

    def __init__(self, prepared: Path, max_far: float, val_count: str = "parts"):
        info = read_summary(prepared)
        self.ok = info["classes"].index(info["ok_class"])
        _, self.y_val, _ = load_split(prepared, "val")
        _, self.y_test, _ = load_split(prepared, "test")
        self.val_ok, self.test_ok = self.y_val == self.ok, self.y_test == self.ok
        self.g_val, self.g_test = load_groups(prepared, "val"), load_groups(prepared, "test")
        self.w_val = group_weights(self.g_val, ~self.val_ok)
        if val_count == "images":  # every val OK image weighs one in the cut, as the goal counts the test split
            self.w_val = np.where(self.val_ok, 1.0, self.w_val)
        self.w_test = group_weights(self.g_test, ~self.test_ok)
        # val and test pooled (val first), for the re-drawn partitions
        self.groups = np.concatenate([self.g_val, self.g_test])
        self.is_defect = ~np.concatenate([self.val_ok, self.test_ok])
        self.max_far = max_far
        self.val_count = val_count

    def draws(self, n: int, seed: int = 0) -> list[np.ndarray]:
        """N re-drawn partitions of val + test (pooled, val first): True where an image sets the cut."""
        return redrawn_partitions(self.groups, len(self.y_val) / len(self.groups), n, seed)

    def redrawn(self, members: list[tuple[np.ndarray, np.ndarray]], draws: list[np.ndarray]) -> dict:
        """The ensemble's recall at the cut, share within the budget and oracle over ``draws`` (the val OK
        images counted as the cut counts them: ``--val-count``)."""
        probs = np.concatenate([np.mean([m[0] for m in members], axis=0), np.mean([m[1] for m in members], axis=0)])
        by_parts = self.val_count == "parts"
        return cut_on_partitions(1 - probs[:, self.ok], self.is_defect, self.groups, draws, self.max_far, by_parts)

    def __call__(self, members: list[tuple[np.ndarray, np.ndarray]]) -> dict:
        val = np.mean([m[0] for m in members], axis=0)
        test = np.mean([m[1] for m in members], axis=0)
        sv, st = 1 - val[:, self.ok], 1 - test[:, self.ok]
        cut = threshold_for_false_alarms(sv[self.val_ok], self.max_far, self.w_val[self.val_ok])
        at = binary_metrics(st, ~self.test_ok, cut)
        flagged = st[self.test_ok] >= cut
        ok_scores = np.sort(st[self.test_ok])[::-1]
        oracle_cut = ok_scores[int(self.max_far * len(ok_scores))]
        return {
            "recall": at["defect_recall"],
            "far": at["false_alarm_rate"],
            "far_parts": float((self.w_test[self.test_ok] * flagged).sum() / self.w_test[self.test_ok].sum()),
            "auc": roc_auc(st, ~self.test_ok),
            "oracle": float((st[~self.test_ok] > oracle_cut).mean()),
            "accuracy": float((test.argmax(1) == self.y_test).mean()),
        }


def combinations(mix: list[tuple[str, int]], seeds: dict[str, list[int]]) -> list[list[tuple[str, int]]]:
    per_lever = [list(itertools.combinations(seeds.get(lever, []), n)) for lever, n in mix]
    return [[(lever, s) for (lever, _), chosen in zip(mix, pick, strict=True) for s in chosen]
            for pick in itertools.product(*per_lever)]  # fmt: skip


def layout(mix: list[tuple[str, int]], seeds: dict[str, list[int]]) -> list[tuple[int, list[tuple[str, int]]]]:
    """The members train.ensemble_members trains for train.seed s, in the mix's order: member k has seed s + k."""
    order = [lever for lever, n in mix for _ in range(n)]
    starts = sorted({s for found in seeds.values() for s in found})
    rows = []
    for s in starts:
        members = [(lever, s + k) for k, lever in enumerate(order)]
        if all(seed in seeds.get(lever, []) for lever, seed in members):
            rows.append((s, members))
    return rows


def log_to_mlflow(mlflow_params: dict, sweeps: list[Path], summary: dict[str, dict], table: Path) -> None:
    """A run ``ensemble mix`` with the table as an artifact and each mix's figures as metrics."""
    from pipeline import tracking
    from pipeline.config import MlflowConfig
    from pipeline.sweep import slug

    try:
        with tracking.open_run(MlflowConfig(**mlflow_params), run_name="ensemble mix") as run:
            run.log_params({"sweeps": ", ".join(map(str, sweeps)), "mixes": " | ".join(summary)})
            for text, figures in summary.items():
                run.log_metrics({f"{slug(text)}.{k}": v for k, v in figures.items()})
            run.log_artifacts(table, "ensemble_mix")
            print(f"MLflow run {run.run_id} (ensemble mix)", file=sys.stderr)
    except tracking.TrackingUnavailable as exc:
        print(f"not logged to MLflow ({exc}); the table is in {table}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="sweep result folders (sweeps/<name>)")
    ap.add_argument("--mix", action="append", required=True, help="LEVER:COUNT[,LEVER:COUNT...]")
    ap.add_argument("--prepared", type=Path, default=Path("data/prepared"))
    ap.add_argument(
        "--prepared-at",
        action="append",
        default=[],
        metavar="SIZE=DIR",
        help="the same splits prepared at another prepare.image_size, for members trained at that size",
    )
    ap.add_argument("--max-false-alarm-rate", type=float, default=0.03)
    ap.add_argument("--val-count", choices=["parts", "images"], default="parts",
                    help="the val OK images in the cut: each near-duplicate group weighs one (parts, the evaluate "
                         "stage's rule) or each image does (images, as the goal counts test false alarms)")  # fmt: skip
    ap.add_argument(
        "--redraw",
        type=int,
        default=0,
        metavar="N",
        help="also score each ensemble on N re-drawn val/test partitions of the held-out parts",
    )
    ap.add_argument("--out", type=Path, help="the table (markdown); default: <first sweep>/ensemble_mix.md")
    args = ap.parse_args(argv)

    mixes = [(text, parse_mix(text)) for text in args.mix]
    runs = finished_runs(args.sweeps)
    seeds: dict[str, list[int]] = {}
    for lever, seed in sorted(runs):
        seeds.setdefault(lever, []).append(seed)
    for text, mix in mixes:
        for lever, n in mix:
            if len(seeds.get(lever, [])) < n:
                raise SystemExit(f"--mix {text!r}: {lever!r} has {len(seeds.get(lever, []))} finished runs, "
                                 f"{n} needed (levers found: {', '.join(sorted(seeds))})")  # fmt: skip
    needed = sorted({(lever, s) for _, mix in mixes for lever, _ in mix for s in seeds[lever]})
    info = read_summary(args.prepared)
    at = {info["image_size"]: args.prepared, **sizes_prepared(args.prepared, args.prepared_at)}
    for key in needed:
        used = runs[key]["params"]
        size = used["prepare"]["image_size"]
        if used["data"]["ok_class"] != info["ok_class"] or size not in at:
            raise SystemExit(f"{runs[key]['dir']}: trained on other data than {args.prepared} (ok class "
                             f"{used['data']['ok_class']!r}, {size} px); run the sweep's last run again (dvc repro) "
                             f"first, or give the same splits at that size: --prepared-at {size}=DIR")  # fmt: skip
    probs = score_runs(runs, needed, at)
    judge = Judge(args.prepared, args.max_false_alarm_rate, args.val_count)

    far = f"{args.max_false_alarm_rate:.0%}"
    lines = [
        f"| mix | ensembles | recall at the val {far} threshold, mean (lowest) | within {far} test false alarms, "
        f"by images / by parts | test AUC | oracle | accuracy |"
        + (f" re-drawn splits ({args.redraw}): recall, within {far}, oracle |" if args.redraw else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if args.redraw else ""),
    ]
    draws = judge.draws(args.redraw)
    layouts, summary = [], {}
    for text, mix in mixes:
        rows = [judge([probs[m] for m in members]) for members in combinations(mix, seeds)]
        mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        within = sum(r["far"] <= args.max_false_alarm_rate + 1e-9 for r in rows)
        within_parts = sum(r["far_parts"] <= args.max_false_alarm_rate + 1e-9 for r in rows)
        lowest = min(r["recall"] for r in rows)
        summary[text] = {"recall_mean": mean["recall"], "recall_lowest": lowest, "auc_mean": mean["auc"],
                         "within_budget_share": within / len(rows), "ensembles": len(rows)}  # fmt: skip
        line = (f"| {text} | {len(rows)} | {mean['recall']:.2f} ({lowest:.2f}) | {within} / {within_parts} of "
                f"{len(rows)} | {mean['auc']:.3f} | {mean['oracle']:.2f} | {mean['accuracy']:.2f} |")  # fmt: skip
        if draws:
            again = [judge.redrawn([probs[m] for m in members], draws) for members in combinations(mix, seeds)]
            again_mean = {k: float(np.mean([r[k] for r in again])) for k in again[0]}
            summary[text].update({f"redrawn_{k}": v for k, v in again_mean.items()})
            line += f" {again_mean['recall']:.2f}, {again_mean['within']:.0%}, {again_mean['oracle']:.2f} |"
        lines.append(line)
        for s, members in layout(mix, seeds):
            r = judge([probs[m] for m in members])
            layouts.append(f"| {text} | {s} | {', '.join(f'{lever} {seed}' for lever, seed in members)} | "
                           f"{r['recall']:.2f} ({r['far']:.2f}) | {r['auc']:.3f} | {r['accuracy']:.2f} |")  # fmt: skip
    lines += ["", "| mix | train.seed | members (lever, seed) | recall (test false alarms) | test AUC | accuracy |",
              "|---|---|---|---|---|---|", *layouts]  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    out = args.out or args.sweeps[0] / "ensemble_mix.md"
    out.write_text(table)
    log_to_mlflow(runs[needed[0]]["params"]["mlflow"], args.sweeps, summary, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
