"""``defect sweep LEVERS.yaml``: measure levers (param changes) over several seeds, paired by seed, through
the real pipeline, and report the table a person compares them by: in ``sweeps/<name>/`` and in MLflow.

A levers file names a base (params changed for every run, e.g. the data source), the seeds, and the levers,
each a set of params changed from that base; the first lever is the reference the others are paired with::

    name: magnetic-tiles
    base: {data.source: ../shared/datasets/magnetic_tile, data.ok_class: free}
    seeds: [0, 1, 2]
    levers:
      default: {}
      label smoothing 0.1: {train.label_smoothing: 0.1}

Each run writes params.yaml and runs ``dvc repro <until>`` (evaluate by default), so every stage a lever
touches reruns and the rest comes from DVC's cache; its figures are copied to ``sweeps/<name>/<lever>/seed<k>``
and ``result.json`` there marks it done, so a killed sweep resumes where it stopped (a finished run whose
params differ from today's, e.g. by a key params.yaml gained since, runs again, the keys named). params.yaml is put back
at the end. The summary (``summary.md``, ``summary.csv``, ``levers.png``) goes to a sweep run in MLflow, with
each lever's training runs nested under it. Seed noise on small real datasets is often larger than a lever's
effect (README), hence seeds and pairing rather than one run per lever.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from pipeline.config import ConfigError, apply_changes, as_flat_dict, params_from_dict

SWEEPS_DIR = Path("sweeps")
# The figures of one run: the goal's (recall at the val-chosen false-alarm threshold) first.
EVALUATE_KEYS = {
    "recall_at_far": "defect_recall_at_far_threshold",
    "far": "false_alarm_rate_at_far_threshold",
    "auc": "roc_auc",
    "accuracy": "accuracy",
    "pointing_game": "pointing_game",
}
COPIED = [
    "reports/evaluate/metrics.json",
    "reports/evaluate/per_class.json",
    "reports/evaluate/roc.png",
    "reports/train/metrics.json",
    "reports/train/history.csv",
]


@dataclass(frozen=True)
class Sweep:
    name: str
    base: dict
    seeds: list[int]
    levers: dict[str, dict]  # lever name -> {dotted key: value}; the first is the reference


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "lever"


def load_sweep(path: Path) -> Sweep:
    if not path.is_file():
        raise ConfigError(f"{path}: levers file not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with name, base, seeds and levers")
    unknown = set(raw) - {"name", "base", "seeds", "levers"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)} (expected name, base, seeds, levers)")
    levers = raw.get("levers")
    if not isinstance(levers, dict) or not levers:
        raise ConfigError(f"{path}: levers: expected a mapping of lever name -> params changed (first: the reference)")
    for name, change in levers.items():
        if not isinstance(change, dict | None):
            raise ConfigError(f"{path}: levers.{name}: expected a mapping of dotted param keys to values")
    slugs = [slug(str(n)) for n in levers]
    if len(set(slugs)) != len(slugs):
        raise ConfigError(f"{path}: levers: two names map to the same folder name ({slugs})")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: seeds: expected a list of integers (train.seed of each run), got {seeds!r}")
    base = raw.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: base: expected a mapping of dotted param keys to values")
    return Sweep(str(raw.get("name") or path.stem), base, seeds, {str(k): v or {} for k, v in levers.items()})


def plan(sweep: Sweep, params: dict) -> list[tuple[str, int, dict]]:
    """Every (lever, seed, params) of the sweep, each checked like params.yaml before anything runs."""
    base = apply_changes(params, sweep.base, "base")
    runs = []
    for lever, changes in sweep.levers.items():
        for seed in sweep.seeds:
            p = apply_changes(base, {**changes, "train.seed": seed}, f"levers.{lever}")
            params_from_dict(p, source_file=f"levers.{lever} (seed {seed})")  # ConfigError names the key
            runs.append((lever, seed, p))
    return runs


def read_result(run_dir: Path, lever: str, seed: int, wall_s: float, rc: int) -> dict:
    row: dict = {"lever": lever, "seed": seed, "wall_s": round(wall_s, 1), "rc": rc}
    evaluation = run_dir / "reports/evaluate/metrics.json"
    if rc == 0 and evaluation.is_file():
        m = json.loads(evaluation.read_text())
        row.update({short: m.get(key) for short, key in EVALUATE_KEYS.items()})
        per_class = json.loads((run_dir / "reports/evaluate/per_class.json").read_text())
        row["per_class_recall"] = {c: round(v["recall"], 3) for c, v in per_class.items()}
        row["train_s"] = training_seconds(json.loads((run_dir / "reports/train/metrics.json").read_text()))
    return row


def training_seconds(t: dict) -> float | None:
    """Training alone, without the stages before and after it, from the train stage's metrics.json; an
    ensemble's is the sum of its members' (its own summary has no epoch count: members may differ)."""
    if "members" in t:
        parts = [training_seconds(m) for m in t["members"]]
        return None if None in parts else round(sum(parts), 1)
    if not t.get("train_img_s"):
        return None
    per_epoch = t.get("epoch_images", t["train_images"])
    return round(t["epochs_run"] * per_epoch / t["train_img_s"], 1)


def stage_env() -> dict[str, str]:
    """The stages' ``python`` is this interpreter's (the venv's), also when ``defect`` is called by its path
    without activating the venv, as ``make`` arranges for ``dvc repro``."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def params_changed(run_dir: Path, params: dict) -> str:
    """How the params a finished run used differ from the ones it would run with now ("" when they do not):
    e.g. a key params.yaml gained since, which makes the run start again (its default may not be what the
    code did before). Named, so the hours a rerun costs are never spent silently."""
    before, now = as_flat_dict(yaml.safe_load((run_dir / "params.yaml").read_text())), as_flat_dict(params)
    missing = "(absent)"
    return ", ".join(
        f"{key}: {json.dumps(before.get(key, missing))} -> {json.dumps(now.get(key, missing))}"
        for key in sorted(before.keys() | now.keys()) if before.get(key, missing) != now.get(key, missing)
    )  # fmt: skip


def run_one(params: dict, run_dir: Path, until: str, lever: str, seed: int) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(params, sort_keys=False)
    Path("params.yaml").write_text(text)
    (run_dir / "params.yaml").write_text(text)
    start = time.monotonic()
    with open(run_dir / "dvc.log", "w") as log:
        cmd = [sys.executable, "-m", "dvc", "repro", until]
        # its own process group: dvc runs each stage as a child, which a signal to dvc alone would orphan
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=stage_env(), start_new_session=True)
        try:
            rc = proc.wait()
        except BaseException:  # Ctrl-C or kill: stop dvc and the stage too (a killed training resumes next time)
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    wall = time.monotonic() - start
    for f in COPIED:
        if rc == 0 and Path(f).is_file():
            (run_dir / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, run_dir / f)
    row = read_result(run_dir, lever, seed, wall, rc)
    if rc == 0 and Path("models/train/run.json").is_file():
        row["mlflow_run_id"] = json.loads(Path("models/train/run.json").read_text())["run_id"]
    if rc == 0:
        (run_dir / "result.json").write_text(json.dumps(row, indent=2))  # written last: the run is done
    return row


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def summarize(sweep: Sweep, rows: list[dict], max_far: float) -> list[dict]:
    """One row per lever: its seeds' recall at the val-chosen threshold (test false alarms), means, and the
    mean paired difference with the reference lever over the seeds both finished."""
    reference = list(sweep.levers)[0]
    ref = {r["seed"]: r for r in rows if r["lever"] == reference and r["rc"] == 0}
    table = []
    for lever in sweep.levers:
        done = sorted((r for r in rows if r["lever"] == lever and r["rc"] == 0), key=lambda r: r["seed"])
        paired = [r["recall_at_far"] - ref[r["seed"]]["recall_at_far"] for r in done if r["seed"] in ref]
        table.append(
            {
                "lever": lever,
                "changes": json.dumps(sweep.levers[lever]),
                "seeds": len(done),
                "failed": sum(r["lever"] == lever and r["rc"] != 0 for r in rows),
                "recall_at_far_by_seed": " / ".join(f"{r['recall_at_far']:.2f} ({r['far']:.2f})" for r in done),
                "recall_at_far_mean": _mean(done, "recall_at_far"),
                "recall_vs_reference": float(np.mean(paired)) if paired and lever != reference else float("nan"),
                "seeds_within_far": sum(r["far"] <= max_far + 1e-9 for r in done),
                "auc_mean": _mean(done, "auc"),
                "accuracy_mean": _mean(done, "accuracy"),
                "pointing_game_mean": _mean(done, "pointing_game"),
                "train_s_mean": _mean(done, "train_s"),
                "wall_s_mean": _mean(done, "wall_s"),
            }
        )
    return table


def write_table(table: list[dict], out: Path, sweep: Sweep, max_far: float) -> None:
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)

    def num(x: float, digits: int = 2, sign: str = "") -> str:
        return "" if x != x else f"{x:{sign}.{digits}f}"  # NaN (no seed finished): an empty cell

    lines = [
        f"# Sweep {sweep.name}: seeds {sweep.seeds}, paired with `{list(sweep.levers)[0]}`",
        "",
        f"Recall: test defect recall at the threshold chosen on the val split for <= {max_far:.0%} false alarms "
        "(test false alarms in brackets). Training: seconds of training alone; wall: the whole `dvc repro`.",
        "",
        "| lever | params changed | recall by seed (test false alarms) | mean | vs reference (paired) "
        "| seeds within false alarms | test AUC | accuracy (all classes) | pointing game | training s | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        lines.append(
            f"| {r['lever']} | `{r['changes']}` | {r['recall_at_far_by_seed']}"
            + (f" ({r['failed']} failed)" if r["failed"] else "")
            + f" | {num(r['recall_at_far_mean'])} | {num(r['recall_vs_reference'], sign='+')} "
            f"| {r['seeds_within_far']} of {r['seeds']} "
            f"| {num(r['auc_mean'], 3)} | {num(r['accuracy_mean'])} | {num(r['pointing_game_mean'])} "
            f"| {num(r['train_s_mean'], 0)} | {num(r['wall_s_mean'], 0)} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def plot_levers(rows: list[dict], sweep: Sweep, max_far: float, path: Path) -> None:
    from pipeline.plots import plt

    levers = list(sweep.levers)
    fig, axes = plt.subplots(1, 3, figsize=(13, 1.0 + 0.5 * len(levers)), sharey=True)
    for ax, key, label in zip(
        axes,
        ("recall_at_far", "auc", "train_s"),
        (f"test recall at the val {max_far:.0%} threshold", "test ROC AUC", "training seconds"),
        strict=True,
    ):
        for i, lever in enumerate(levers):
            done = [r for r in rows if r["lever"] == lever and r["rc"] == 0 and r.get(key) is not None]
            if not done:
                continue
            over = [r.get("far", 0) > max_far + 1e-9 for r in done]
            ax.scatter([r[key] for r in done], [i] * len(done), c=["#c44e52" if o else "#4c72b0" for o in over], s=30)
            ax.plot([np.mean([r[key] for r in done])] * 2, [i - 0.3, i + 0.3], color="black", lw=2)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(levers)), levers)
    axes[0].invert_yaxis()
    fig.suptitle(f"sweep {sweep.name}: one dot per seed (red: over {max_far:.0%} test false alarms), bar = mean")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_to_mlflow(sweep: Sweep, params: dict, table: list[dict], rows: list[dict], out: Path) -> str | None:
    """A run ``sweep <name>`` holding the table and plot; each lever's training runs nested under it."""
    from pipeline import tracking

    cfg = params_from_dict(params).mlflow
    try:
        with tracking.open_run(cfg, run_name=f"sweep {sweep.name}", tags={"sweep": sweep.name}) as run:
            run.log_params({"seeds": sweep.seeds, "base": json.dumps(sweep.base)})
            run.log_params({f"lever.{slug(r['lever'])}": r["changes"] for r in table})
            for r in table:
                values = {k: r[k] for k in ("recall_at_far_mean", "auc_mean", "accuracy_mean", "train_s_mean")}
                run.log_metrics({f"{slug(r['lever'])}.{k}": v for k, v in values.items() if v == v})
            for name in ("summary.md", "summary.csv", "levers.png"):
                run.log_artifacts(out / name, "sweep")
            for r in rows:
                if r.get("mlflow_run_id"):
                    child = tracking.Run(run.client, r["mlflow_run_id"], run.buffer)
                    nest = {"mlflow.parentRunId": run.run_id, "sweep.lever": r["lever"], "sweep.seed": r["seed"]}
                    child.set_tags(nest)
            return run.run_id
    except tracking.TrackingUnavailable as exc:
        print(f"sweep: not logged to MLflow ({exc}); the table is in {out}", flush=True)
        return None


def run_sweep(levers_file: Path, until: str = "evaluate") -> int:
    """Run every lever at every seed (run from the project root: dvc reads ./params.yaml)."""
    sweep = load_sweep(levers_file)
    params_file = Path("params.yaml")
    original = params_file.read_text()
    params = yaml.safe_load(original)
    runs = plan(sweep, params)  # every run's params checked before the first starts
    out = SWEEPS_DIR / slug(sweep.name)
    rows = []
    # a plain kill (SIGTERM) unwinds like Ctrl-C, so params.yaml is put back and the stage stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for i, (lever, seed, p) in enumerate(runs, 1):
            run_dir = out / slug(lever) / f"seed{seed}"
            done = run_dir / "result.json"
            if done.is_file():
                changed = params_changed(run_dir, p)
                if not changed:
                    rows.append(json.loads(done.read_text()))
                    print(f"[{i}/{len(runs)}] {lever}, seed {seed}: done before, kept", flush=True)
                    continue
                print(f"[{i}/{len(runs)}] {lever}, seed {seed}: done before with other params ({changed}), "
                      "so it runs again", flush=True)  # fmt: skip
            print(f"[{i}/{len(runs)}] {lever}, seed {seed}: dvc repro {until} (log: {run_dir / 'dvc.log'})", flush=True)
            row = run_one(p, run_dir, until, lever, seed)
            rows.append(row)
            if row["rc"]:
                print(f"    failed (exit {row['rc']}): see {run_dir / 'dvc.log'}", flush=True)
            else:
                print(
                    f"    recall {row['recall_at_far']:.2f} at {row['far']:.2f} test false alarms, "
                    f"AUC {row['auc']:.3f}, "
                    f"accuracy {row['accuracy']:.2f}, {row['wall_s']:.0f} s",
                    flush=True,
                )
    finally:
        params_file.write_text(original)
        print("params.yaml put back; `dvc repro` returns the workspace to it (from DVC's cache if it ran before)")
    max_far = params_from_dict(runs[0][2]).evaluate.max_false_alarm_rate
    table = summarize(sweep, rows, max_far)
    write_table(table, out, sweep, max_far)
    plot_levers(rows, sweep, max_far, out / "levers.png")
    (out / "runs.json").write_text(json.dumps(rows, indent=2))
    run_id = log_to_mlflow(sweep, runs[0][2], table, rows, out)
    print((out / "summary.md").read_text())
    print(f"table: {out / 'summary.md'}, plot: {out / 'levers.png'}" + (f", MLflow run {run_id}" if run_id else ""))
    return 1 if any(r["rc"] for r in rows) else 0
