"""``defect-runner``: the edge runner's command line.

defect-runner predict --model models/export/model.onnx images/ more/*.png --out results.jsonl
defect-runner watch --model models/export/model.onnx /line7/inbox --out /line7
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import sys

from serving.card import CardError
from serving.runner import Runner, RunnerError, expand_inputs


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="path to the exported .onnx file")
    p.add_argument("--card", help="model card JSON (default: <model>.card.json beside the model)")
    p.add_argument(
        "--providers",
        default="auto",
        help="auto, or a comma list in order of preference: tensorrt,cuda,cpu (default: auto)",
    )
    p.add_argument(
        "--allow-cpu-fallback",
        action="store_true",
        help="run on the CPU when the asked-for GPU provider cannot start, instead of failing",
    )
    p.add_argument("--force", action="store_true", help="load a model whose card marks it not deployable")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: all cores)")


def cmd_predict(args: argparse.Namespace) -> int:
    runner = Runner(args.model, args.card, args.providers, args.allow_cpu_fallback, args.force, args.threads)
    files = expand_inputs(args.inputs)
    out = open(args.out, "w", newline="") if args.out else sys.stdout  # noqa: SIM115 (closed below)
    fmt = args.format or ("csv" if args.out and args.out.endswith(".csv") else "jsonl")
    writer = None
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(
            [
                "path",
                "class",
                *[f"p_{c}" for c in runner.card.classes],
                "defect_score",
                "decision",
                "latency_ms",
                "error",
            ]
        )
    try:
        from tqdm import tqdm  # optional: a progress bar when it is installed and output is a file
    except ImportError:  # pragma: no cover
        tqdm = None
    rows = runner.predict_files(files, args.batch_size)
    if tqdm is not None and args.out:
        rows = tqdm(rows, total=len(files), unit="img")
    errors = 0
    for r in rows:
        errors += bool(r.error)
        if writer:
            probs = [r.probs[c] if r.probs else "" for c in runner.card.classes]
            writer.writerow(
                [
                    r.path,
                    r.label or "",
                    *probs,
                    "" if r.defect_score is None else r.defect_score,
                    r.decision or "",
                    f"{r.latency_ms:.2f}",
                    r.error,
                ]
            )
        else:
            out.write(json.dumps(dataclasses.asdict(r)) + "\n")
    if args.out:
        out.close()
    print(f"scored {len(files) - errors} of {len(files)} files ({errors} unreadable)", file=sys.stderr)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    from serving.watch import ReviewRule, Watcher

    runner = Runner(args.model, args.card, args.providers, args.allow_cpu_fallback, args.force, args.threads)
    out = Path(args.out)
    watcher = Watcher(
        runner,
        Path(args.inbox),
        out / "results.jsonl",
        out / "done",
        out / "failed",
        out / "review",
        ReviewRule(args.review_margin, args.review_min_confidence),
        settle=args.settle,
        batch_size=args.batch_size,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # finish the batch in hand, then stop
        signal.signal(sig, lambda *_: (watcher.stop.set(), watcher.wake.set()))
    counts = watcher.run(once=args.once)
    print(
        f"watch: {counts['done']} scored, {counts['failed']} failed, {counts['review']} sent to review", file=sys.stderr
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="defect-runner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="score files, folders or globs; write JSONL or CSV")
    _add_model_args(p)
    p.add_argument("inputs", nargs="+", help="image files, folders (recursive) or globs")
    p.add_argument("--out", help="output file (.jsonl or .csv); default: JSONL on stdout")
    p.add_argument("--format", choices=["jsonl", "csv"])
    p.add_argument("--batch-size", type=int, default=16)
    p.set_defaults(func=cmd_predict)

    w = sub.add_parser(
        "watch",
        help="score images as they land in a folder; move them to done/ or failed/; queue unsure ones",
        description="Scores each file once it is completely written (size and mtime stable for --settle s), "
        "appends the result to OUT/results.jsonl, moves the image to OUT/done or OUT/failed (never deletes), "
        "and copies images the model is unsure about to OUT/review/<class>/ for labeling (defect ingest).",
    )
    _add_model_args(w)
    w.add_argument("inbox", help="the folder to watch")
    w.add_argument("--out", required=True, help="folder for results.jsonl, done/, failed/ and review/")
    w.add_argument("--settle", type=float, default=1.0, help="seconds a file must stay unchanged (default 1)")
    w.add_argument("--review-margin", type=float, default=0.1, help="queue scores this close to the threshold")
    w.add_argument("--review-min-confidence", type=float, default=0.6, help="queue top probabilities below this")
    w.add_argument("--batch-size", type=int, default=16)
    w.add_argument("--once", action="store_true", help="score what is in the inbox, then exit")
    w.set_defaults(func=cmd_watch)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (RunnerError, CardError) as exc:
        print(f"defect-runner: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
