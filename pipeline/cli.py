"""``defect``: the pipeline's command line for people (the stages themselves run through ``dvc repro``).

defect check [--profile NAME] [-S k=v]  # params and the data folder checked, nothing run
defect exp --profile NAME [-S k=v]       # a profile's recipe (profiles/NAME.yaml) as one `dvc exp run`
defect ingest NEW_FOLDER [--name NAME]   # add a batch of newly labeled images, then `dvc repro`
defect mlflow-flush                      # send what stages buffered while the tracking server was down
defect sweep sweeps/LEVERS.yaml          # levers x seeds as DVC experiments (its queue); table in sweeps/ and MLflow
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pipeline.config import ConfigError, load_params
from pipeline.data.batches import BATCHES_DIR, add_batch, dvc_track
from pipeline.profiles import check_command, exp_command
from pipeline.tracking import BUFFER_ROOT, flush_all


def ingest_command(args: argparse.Namespace) -> int:
    params = load_params(args.params)
    report = add_batch(args.folder, params, args.name, allow_new_class=args.allow_new_class)
    added, dropped = len(report["added"]), len(report["dropped"])
    print(f"batch {report['name']}: {added} images added {report['counts']}, {dropped} dropped")
    for d in report["dropped"]:
        print(f"  dropped {d['path']}: {d['reason']}")
    for w in report["warnings"]:
        print(f"  warning {w}")
    if report["added"] and not args.no_dvc:
        print(dvc_track(BATCHES_DIR / report["name"]))
    print(f"report: {BATCHES_DIR / (report['name'] + '.json')}; next: dvc repro (retrains on old plus new)")
    conflicts = sum(d["reason"].startswith("label conflict") for d in report["dropped"])
    return 3 if conflicts and args.strict else 0


def flush_command(args: argparse.Namespace) -> int:
    result = flush_all(BUFFER_ROOT)
    if not result:
        print(f"nothing buffered in {BUFFER_ROOT}")
    for uri, (sent, pending) in result.items():
        print(f"{uri}: sent {sent} logging calls, {pending} still waiting")
    return 1 if any(pending for _, pending in result.values()) else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="defect", description="Defect-detection pipeline tools")
    sub = ap.add_subparsers(dest="command", required=True)
    ing = sub.add_parser("ingest", help="add a folder of newly labeled images (class subfolders) as a batch")
    ing.add_argument("folder", type=Path)
    ing.add_argument("--name", help="batch name (default: the current date and time)")
    ing.add_argument("--params", default="params.yaml")
    ing.add_argument("--allow-new-class", action="store_true", help="accept class folders the dataset lacks")
    ing.add_argument("--no-dvc", action="store_true", help="do not `dvc add` the batch folder")
    ing.add_argument("--strict", action="store_true", help="exit 3 when any label conflict was found")
    chk = sub.add_parser("check", help="check params and the data folder before anything runs")
    exp = sub.add_parser("exp", help="run a profile's recipe (profiles/NAME.yaml) as one DVC experiment")
    for p in (chk, exp):
        p.add_argument("--profile", help="a recipe in profiles/, e.g. photographs (default: params.yaml alone)")
        p.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="a params change")
    exp.add_argument("-n", "--name", help="the experiment's name (dvc exp run -n)")
    exp.add_argument("--queue", action="store_true", help="queue it (dvc exp run --queue) instead of running it")
    exp.add_argument("--dry-run", action="store_true", help="print the dvc command, run nothing")
    sub.add_parser("mlflow-flush", help="send MLflow calls buffered while the tracking server was unreachable")
    sw = sub.add_parser("sweep", help="measure levers (param changes) over seeds, paired, as queued DVC experiments")
    sw.add_argument("levers", type=Path, help="a levers file, e.g. sweeps/magnetic_tiles.yaml")
    sw.add_argument("--until", default="evaluate", help="the last stage each experiment runs (default: evaluate)")
    sw.add_argument("--jobs", type=int, default=1, help="experiments run at a time (dvc exp run --run-all -j)")
    args = ap.parse_args(argv)
    if args.command == "mlflow-flush":
        return flush_command(args)
    try:
        if args.command == "check":
            return check_command(args.profile, args.set)
        if args.command == "exp":
            return exp_command(args.profile, args.set, args.name, args.queue, args.dry_run)
        if args.command == "sweep":
            from pipeline.sweep import run_sweep  # its own module's imports (dvc, mlflow) only when sweeping

            return run_sweep(args.levers, args.until, args.jobs)
        return ingest_command(args)
    except ConfigError as exc:
        print(f"defect {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
