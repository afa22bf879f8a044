"""``defect sweep LEVERS.yaml``: measure levers (param changes) over several seeds, paired by seed, as DVC
experiments, and report the table a person compares them by: in ``sweeps/<name>/`` and in MLflow.

A levers file names a base (params changed for every run, e.g. the data source), the seeds, and the levers,
each a set of params changed from that base; the first lever is the reference the others are paired with::

    name: magnetic-tiles
    base: {data.source: ../shared/datasets/magnetic_tile, data.ok_class: free}
    seeds: [0, 1, 2]
    levers:
      default: {}
      label smoothing 0.1: {train.label_smoothing: 0.1}

Every key is checked against params.yaml before anything is queued. Each (lever, seed) is then one experiment
in DVC's own queue, named ``<sweep>-<lever>-s<seed>``; the sweep runs, in the project root::

    dvc exp show --json                                  # what this commit's experiments already hold
    dvc exp run --queue -n magnetic-tiles-label-smoothing-0-1-s0 -S train.label_smoothing=0.1 -S train.seed=0 \
        ... evaluate                                     # one per run still to do (-S: the changes, params.yaml's keys)
    dvc exp run --run-all -j 1                           # a queue worker (as dvc queue start) runs them; logs followed
    dvc exp show --json                                  # each experiment's params and metrics: the table

A queued experiment runs in a copy of the project under ``.dvc/tmp/exps`` (git-tracked files, outputs from DVC's
cache, so stages a lever does not touch come from the run cache) and is kept as a git ref with its outputs in the
cache (``dvc exp show``, ``dvc exp apply NAME``). The workspace is never run in: params.yaml is only touched while
DVC stashes each experiment's changes at queue time, and is back byte for byte when ``dvc exp run --queue``
returns, so work can go on beside a sweep. Measured on this project (DVC 3.67):

- a relative path in params points into that copy, where a stage found no images and an sqlite MLflow store
  would vanish with the copy; so ``data.source``, ``model.pretrained``, ``train.init_from`` and an sqlite
  ``mlflow.tracking_uri`` are made absolute first (queued as changes, so ``dvc exp show`` says so);
- files git does not track are not copied: commit or ``git add`` what the stages need;
- values go through Hydra's override grammar (``-S key=value``), which merges a mapping into the one it
  replaces; a mapping whose keys hold dots (``tiles.recipe``) is therefore queued as ``~key`` then ``+key=...``.
  DVC writes the file back as YAML 1.2, the stages read 1.1: a float under 1e-4 (``1e-05``) would reach them as
  a string. So every queued params.yaml is read back as the stages read it and compared with the plan before
  the queue starts (a mismatch leaves the queue and names the key);
- a killed run does not resume from its checkpoints (its copy is gone). A sweep started again keeps the
  experiments of this git commit that finished with the planned params, waits for the queued or running
  ones, and queues the rest (a failed one again, one with other params after ``dvc exp remove``);
- Ctrl-C stops following the logs, not the queue: ``dvc queue status``, ``dvc queue kill NAME``;
- the cost: 2 levers x 2 seeds of the tests' tiny project took 152 s in the queue against 133 s of ``dvc repro``
  in place (the runner this replaced), the same figures to the digit: about 5 s a run for the copy, its checkout
  from the cache and the experiment's commit, and 1-2 s to queue it; a magnetic-tile run takes about 7 minutes.

The summary (``summary.md``, ``summary.csv``, ``levers.png``, ``runs.json`` with each run's experiment) goes to
a sweep run in MLflow, with each lever's training runs nested under it. Seed noise on small real datasets is
often larger than a lever's effect (README), hence seeds and pairing rather than one run per lever.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from dvc.api import read as dvc_read

from pipeline import tracking
from pipeline.config import ConfigError, apply_changes, as_flat_dict, params_from_dict
from pipeline.plots import plt
from pipeline.summary import training_seconds

SWEEPS_DIR = Path("sweeps")
# The figures of one run: the goal's (recall at the val-chosen false-alarm threshold) first.
EVALUATE_KEYS = {
    "recall_at_far": "defect_recall",  # at the card's threshold, within the false-alarm ceiling
    "far": "false_alarm_rate",
    "auc": "roc_auc",
    "accuracy": "accuracy",
    "pointing_game": "pointing_game",
}
# Params that may name a file or folder (read from the working directory), with the values that are not paths.
PATH_PARAMS = {
    "data.source": {"synthetic"},
    "model.pretrained": {"false", "hub", "", "none"},
    "train.init_from": {"none", "champion"},
}


@dataclass(frozen=True)
class Sweep:
    name: str
    base: dict
    seeds: list[int]
    levers: dict[str, dict]  # lever name -> {dotted key: value}; the first is the reference


@dataclass(frozen=True)
class Experiment:
    """One entry of ``dvc exp show --json``: a finished, queued, running or failed experiment."""

    name: str
    rev: str  # the experiment's commit (of a queued or failed one: its queue task)
    state: str  # success, queued, running or failed
    metrics: dict  # metrics file -> its contents
    log: str | None  # the queue's log of the run


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "lever"


def experiment_name(sweep: Sweep, lever: str, seed: int) -> str:
    return f"{slug(sweep.name)}-{slug(lever)}-s{seed}"


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
        raise ConfigError(f"{path}: levers: two names map to the same experiment name ({slugs})")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: seeds: expected a list of integers (train.seed of each run), got {seeds!r}")
    base = raw.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{path}: base: expected a mapping of dotted param keys to values")
    return Sweep(str(raw.get("name") or path.stem), base, seeds, {str(k): v or {} for k, v in levers.items()})


def absolute_paths(params: dict, root: Path) -> dict:
    """The paths params name, made absolute against ``root``: a queued run reads them from its copy of the
    project, where a relative path points at nothing (or, for the MLflow store, at a file deleted after it)."""
    changes = {}
    for key, words in PATH_PARAMS.items():
        section, name = key.split(".")
        value = params[section][name]
        if isinstance(value, str) and value.lower() not in words and not os.path.isabs(value):
            changes[key] = os.path.normpath(root / value)
    uri = params["mlflow"]["tracking_uri"]
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        changes["mlflow.tracking_uri"] = f"sqlite:///{os.path.normpath(root / uri.removeprefix('sqlite:///'))}"
    return apply_changes(params, changes, "paths")


def plan(sweep: Sweep, params: dict, root: Path | None = None) -> list[tuple[str, int, dict]]:
    """Every (lever, seed, params) of the sweep, each checked like params.yaml before anything is queued."""
    base = absolute_paths(apply_changes(params, sweep.base, "base"), root or Path.cwd())
    runs = []
    for lever, changes in sweep.levers.items():
        for seed in sweep.seeds:
            p = apply_changes(base, {**changes, "train.seed": seed}, f"levers.{lever}")
            params_from_dict(p, source_file=f"levers.{lever} (seed {seed})")  # ConfigError names the key
            runs.append((lever, seed, p))
    return runs


def hydra_value(value) -> str:
    """``value`` in Hydra's override grammar, which ``dvc exp run -S key=VALUE`` parses: a string is always
    quoted (so "1.0" or "true" stays a string), backslashes escaped only before a quote or at the end."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", str(value))
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + "'"


def set_params(now: dict, planned: dict, prefix: str = "") -> list[str]:
    """The ``-S`` overrides that turn params ``now`` into ``planned``: one per changed value. A mapping is
    descended into unless its keys hold dots (Hydra would read them as a path): then, like a mapping set in
    place of a value, it is deleted and added (``~key``, ``+key=...``), since Hydra merges a mapping it sets."""
    out = []
    for key in [*planned, *(k for k in now if k not in planned)]:
        path = f"{prefix}{key}"
        if key not in planned:
            out.append(f"~{path}")
        elif key not in now:
            out.append(f"+{path}={hydra_value(planned[key])}")
        elif now[key] == planned[key]:
            continue
        elif isinstance(now[key], dict) and isinstance(planned[key], dict):
            if any("." in str(k) for k in [*now[key], *planned[key]]):
                out += [f"~{path}", f"+{path}={hydra_value(planned[key])}"]
            else:
                out += set_params(now[key], planned[key], f"{path}.")
        else:
            out.append(f"{path}={hydra_value(planned[key])}")
    return out


def stage_env() -> dict[str, str]:
    """The stages' ``python`` is this interpreter's (the venv's), also when ``defect`` is called by its path
    without activating the venv, as ``make`` arranges for ``dvc repro``; the queue worker inherits it."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def dvc(*args: str, stream: bool = False) -> str:
    """Run ``dvc ARGS`` (this venv's); its stdout, or a stop naming the command and DVC's message."""
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], env=stage_env(), text=True, capture_output=not stream)
    if proc.returncode:
        raise SystemExit(f"defect sweep: `dvc {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr or ''}")
    return proc.stdout or ""


def show() -> dict[str, list[Experiment]]:
    """This commit's experiments by name, finished, queued, running or failed (``dvc exp show --json``)."""
    found: dict[str, list[Experiment]] = {}
    for baseline in json.loads(dvc("exp", "show", "--json")):
        for entry in baseline.get("experiments") or []:
            rev = entry["revs"][0]
            executor = entry.get("executor") or {}  # none for an experiment run in the workspace: finished
            state, log = executor.get("state") or "success", (executor.get("local") or {}).get("log")
            metrics = {
                path: m["data"] for path, m in ((rev.get("data") or {}).get("metrics") or {}).items() if "data" in m
            }
            name = rev.get("name") or entry.get("name") or rev["rev"][:7]
            found.setdefault(name, []).append(Experiment(name, rev["rev"], state, metrics, log))
    return found


def held_params(rev: str) -> dict:
    """params.yaml of an experiment or queued task as the stages read it (YAML 1.1, where DVC reads 1.2: a
    bare ``off`` is false to them, and ``1e-05``, which DVC writes for a float under 1e-4, is a string)."""
    return yaml.safe_load(dvc_read("params.yaml", rev=rev))


def params_changed(before: dict, now: dict) -> str:
    """How the params an experiment holds differ from the planned ones ("" when they do not), e.g. a key
    params.yaml gained since, which makes the run start again (its default may not be what the code did
    before). Named, so the hours a rerun costs are never spent silently. Compared as the stages take them
    (DVC rewrites a quoted 'off' bare, which YAML 1.1 reads as false: the same tiles.use), or as written
    where either no longer loads."""
    try:
        typed = [as_flat_dict(params_from_dict(p, derived=False)) for p in (before, now)]
        before, now = ({k: v for k, v in t.items() if k != "source_file"} for t in typed)
    except ConfigError:
        before, now = as_flat_dict(before), as_flat_dict(now)
    missing = "(absent)"
    return ", ".join(
        f"{key}: {json.dumps(before.get(key, missing))} -> {json.dumps(now.get(key, missing))}"
        for key in sorted(before.keys() | now.keys())
        if before.get(key, missing) != now.get(key, missing)
    )


def triage(name: str, planned: dict, entries: list[Experiment]) -> str:
    """``kept`` (finished with the planned params), ``pending`` (queued or running with them) or ``queue``:
    then a failed entry of that name leaves the queue and a finished one with other params is removed."""
    changed = {e.rev: params_changed(held_params(e.rev), planned) for e in entries if e.state != "failed"}
    for e in entries:
        if e.state != "failed" and not changed[e.rev]:
            return "kept" if e.state == "success" else "pending"
    for e in entries:
        if e.state == "failed":
            dvc("queue", "remove", e.rev)
        elif e.state == "success":
            print(f"    {name} finished with other params ({changed[e.rev]}), so it runs again", flush=True)
            dvc("exp", "remove", e.name)
        else:
            raise SystemExit(
                f"defect sweep: {name} is {e.state} with other params ({changed[e.rev]}): "
                f"`dvc queue kill {name}` or `dvc queue remove {name}` first"
            )
    return "queue"


def queue(sweep: Sweep, runs: list[tuple[str, int, dict]], now: dict, until: str) -> dict[str, int]:
    """Queue every run that no experiment of this commit holds yet; how many were kept, pending, queued."""
    found, queued = show(), {}
    counts = {"kept": 0, "pending": 0, "queue": 0}
    for i, (lever, seed, p) in enumerate(runs, 1):
        name = experiment_name(sweep, lever, seed)
        what = triage(name, p, found.get(name, []))
        counts[what] += 1
        if what == "queue":
            changes = [a for change in set_params(now, p) for a in ("-S", change)]
            dvc("exp", "run", "--queue", "-n", name, *changes, *([until] if until else []))
            queued[name] = p
        said = {"kept": "done before, kept", "pending": "queued before", "queue": "queued"}[what]
        print(f"[{i}/{len(runs)}] {lever}, seed {seed}: {said} (experiment {name})", flush=True)
    found = show()  # what the stages will read is what was planned (the -S values went through Hydra and DVC)
    wrong = {
        e.rev: f"{name}: {changed}"
        for name, p in queued.items()
        for e in found[name]
        if e.state == "queued" and (changed := params_changed(held_params(e.rev), p))
    }
    if wrong:
        dvc("queue", "remove", *wrong)
        raise SystemExit(
            "defect sweep: queued experiments would read other params than planned (removed from "
            "the queue; set such values in params.yaml instead): " + "; ".join(wrong.values())
        )
    return counts


def read_result(e: Experiment | None, lever: str, seed: int) -> dict:
    """One run's row: the evaluate stage's figures, training seconds and its MLflow run (rc 1: failed)."""
    row: dict = {"lever": lever, "seed": seed, "rc": 0 if e and e.state == "success" else 1}
    if e is None or e.state != "success":
        row.update(state=e.state if e else "missing", log=e.log if e else None)
        return row
    row.update(experiment=e.name, rev=e.rev)
    if "reports/evaluate/headline.json" in e.metrics:  # the experiment ran evaluate: its detail files
        evaluation = json.loads(dvc_read("reports/evaluate/metrics.json", rev=e.rev))
        row.update({short: evaluation.get(key) for short, key in EVALUATE_KEYS.items()})
        per_class = json.loads(dvc_read("reports/evaluate/per_class.json", rev=e.rev))
        row["per_class_recall"] = {c: round(v["recall"], 3) for c, v in per_class.items()}
        row["train_s"] = training_seconds(json.loads(dvc_read("reports/train/metrics.json", rev=e.rev)))
        row["mlflow_run_id"] = json.loads(dvc_read("models/train/run.json", rev=e.rev))["run_id"]
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
                "paired_seeds": len(paired) if lever != reference else 0,
                "seeds_within_far": sum(r["far"] <= max_far + 1e-9 for r in done),
                "auc_mean": _mean(done, "auc"),
                "accuracy_mean": _mean(done, "accuracy"),
                "pointing_game_mean": _mean(done, "pointing_game"),
                "train_s_mean": _mean(done, "train_s"),
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
        "(test false alarms in brackets). Paired: the mean difference with the reference over the seeds both "
        "finished (how many in brackets). Training: seconds of training alone. Each run is the DVC experiment "
        f"`{slug(sweep.name)}-<lever>-s<seed>` (`dvc exp show`).",
        "",
        "| lever | params changed | recall by seed (test false alarms) | mean | vs reference (paired) "
        "| seeds within false alarms | test AUC | accuracy (all classes) | pointing game | training s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        paired = num(r["recall_vs_reference"], sign="+")
        paired += f" ({r['paired_seeds']})" if paired else ""
        lines.append(
            f"| {r['lever']} | `{r['changes']}` | {r['recall_at_far_by_seed']}"
            + (f" ({r['failed']} failed)" if r["failed"] else "")
            + f" | {num(r['recall_at_far_mean'])} | {paired} "
            f"| {r['seeds_within_far']} of {r['seeds']} "
            f"| {num(r['auc_mean'], 3)} | {num(r['accuracy_mean'])} | {num(r['pointing_game_mean'])} "
            f"| {num(r['train_s_mean'], 0)} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def plot_levers(rows: list[dict], sweep: Sweep, max_far: float, path: Path) -> None:
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
    cfg = params_from_dict(params).mlflow
    try:
        with tracking.open_run(cfg, run_name=f"sweep {sweep.name}", tags={"sweep": sweep.name}) as run:
            run.log_params({"seeds": sweep.seeds, "base": json.dumps(sweep.base)})
            run.log_params({f"lever.{slug(r['lever'])}": r["changes"] for r in table})
            for r in table:
                values = {k: r[k] for k in ("recall_at_far_mean", "recall_vs_reference", "auc_mean", "train_s_mean")}
                run.log_metrics({f"{slug(r['lever'])}.{k}": v for k, v in values.items() if v == v})
            for name in ("summary.md", "summary.csv", "levers.png", "runs.json"):
                run.log_artifacts(out / name, "sweep")
            for r in rows:
                if r.get("mlflow_run_id"):
                    child = tracking.Run(run.client, r["mlflow_run_id"], run.buffer)
                    child.set_tags(
                        {
                            "mlflow.parentRunId": run.run_id,
                            "sweep.lever": r["lever"],
                            "sweep.seed": r["seed"],
                            "sweep.experiment": r["experiment"],
                        }
                    )
            return run.run_id
    except tracking.TrackingUnavailable as exc:
        print(f"sweep: not logged to MLflow ({exc}); the table is in {out}", flush=True)
        return None


def run_sweep(levers_file: Path, until: str = "evaluate", jobs: int = 1) -> int:
    """Queue every lever at every seed as a DVC experiment, run the queue, table the figures (run from the
    project root, in a git repository with a commit: experiments are based on it)."""
    sweep = load_sweep(levers_file)
    now = yaml.safe_load(Path("params.yaml").read_text())
    runs = plan(sweep, now)  # every run's params checked before the first is queued
    counts = queue(sweep, runs, now, until)
    if counts["queue"] or counts["pending"]:
        start = time.monotonic()
        print(f"running the queue: dvc exp run --run-all -j {jobs} (`dvc queue status` in another shell)", flush=True)
        dvc("exp", "run", "--run-all", "-j", str(jobs), stream=True)
        print(f"the queue ran {counts['queue'] + counts['pending']} experiment(s) in {time.monotonic() - start:.0f} s")
    found = show()
    rows = []
    for lever, seed, _p in runs:
        entries = found.get(experiment_name(sweep, lever, seed), [])
        done = [e for e in entries if e.state == "success"]
        rows.append(read_result((done or entries or [None])[-1], lever, seed))
        if rows[-1]["rc"]:  # still queued or running after a Ctrl-C: the next sweep collects it
            print(f"{lever}, seed {seed}: {rows[-1]['state']} (log: {rows[-1]['log']}; dvc queue status)", flush=True)
    out = SWEEPS_DIR / slug(sweep.name)
    out.mkdir(parents=True, exist_ok=True)
    max_far = params_from_dict(runs[0][2]).evaluate.max_false_alarm_rate
    table = summarize(sweep, rows, max_far)
    write_table(table, out, sweep, max_far)
    plot_levers(rows, sweep, max_far, out / "levers.png")
    (out / "runs.json").write_text(json.dumps(rows, indent=2))
    run_id = log_to_mlflow(sweep, runs[0][2], table, rows, out)
    print((out / "summary.md").read_text())
    print(f"table: {out / 'summary.md'}, plot: {out / 'levers.png'}" + (f", MLflow run {run_id}" if run_id else ""))
    return 1 if any(r["rc"] for r in rows) else 0
