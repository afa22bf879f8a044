"""``defect-runner``: the edge runner's command line.

After ``make run`` (``dvc repro``) in the project folder, the export stage has written
models/export/model.onnx (fp32; model.fp16.onnx and model.int8.onnx beside it, each with its .card.json)
and the promote stage has registered the model as defect-detection, alias champion, in sqlite:///mlflow.db:

defect-runner predict --model models/export/model.onnx images/ more/*.png --out results.csv
defect-runner watch --model models/export/model.onnx /line7/inbox --out /line7
defect-runner serve --model models:/defect-detection@champion --tracking-uri sqlite:///mlflow.db

Every scored row names its defect score, the card's threshold it was compared to, the decision, the most
likely class and a reason (why the two disagree, when they do), and the model and its version. A defect-type
sorting model (its card's ok_class null) decides the most likely class: its rows carry that class's
probability as defect_score and no threshold. A model whose card marks it for review (its operating point
below target) still runs, with a warning.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from serving.card import CardError
from serving.files import list_inputs, score_files, skipped
from serving.registry import RegistryError
from serving.review import ReviewRule
from serving.runner import Prediction, Runner, RunnerError, open_runner
from serving.watch import Watcher

try:
    from tqdm import tqdm  # optional: a progress bar when it is installed and output is a file
except ImportError:  # pragma: no cover
    tqdm = None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="an exported .onnx file with its .card.json beside it (models/export/model.onnx, model.fp16.onnx, "
        "model.int8.onnx), or a registry URI: models:/defect-detection@champion or models:/NAME/VERSION",
    )
    p.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI for models:/ (default: $MLFLOW_TRACKING_URI; the pipeline's own store is "
        "sqlite:///mlflow.db in the project folder)",
    )
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
    p.add_argument("--trt-cache", help="TensorRT engine and timing cache folder (restarts skip the engine build)")
    p.add_argument("--trt-fp16", action="store_true", help="let TensorRT run layers in fp16")


def _add_review_args(p: argparse.ArgumentParser) -> None:
    """The review-queue rule, shared by watch and serve (serving.review.ReviewRule)."""
    p.add_argument(
        "--review-margin",
        type=float,
        default=0.1,
        help="queue scores this close to the threshold (a defect-type sorting model has none: not used)",
    )
    p.add_argument(
        "--review-min-confidence",
        type=float,
        default=0.6,
        help="queue top probabilities below this (a defect-type sorting model's only rule)",
    )


def _add_bounds_args(p: argparse.ArgumentParser) -> None:
    """serve's per-request budget and limits (docs/serving.md, Bounds; serving.server.ServerConfig)."""
    p.add_argument(
        "--max-request-pixels",
        type=int,
        default=40_000_000,
        help="declared pixels one request's images may have, checked before decoding; with a tile model also "
        "the tiles of the largest square within it (default 40000000; README: Bounds)",
    )
    p.add_argument(
        "--request-memory-mb",
        type=float,
        help="memory that decoding and parsing requests may hold at once (default: what one request of "
        "--max-request-pixels needs, 16 bytes a pixel, plus 64 MB kept for small requests)",
    )
    p.add_argument(
        "--max-request-seconds",
        type=float,
        default=30.0,
        help="a request not answered by then gets 503 with Retry-After, 408 if its body is still arriving (30)",
    )
    p.add_argument("--max-header-kb", type=int, default=64, help="request line and headers, at most (default 64)")
    p.add_argument("--max-headers", type=int, default=100, help="headers per request, at most (default 100)")
    p.add_argument("--max-connections", type=int, default=128, help="concurrent connections (default 128)")


def _runner(args: argparse.Namespace) -> Runner:
    return open_runner(
        args.model,
        args.card,
        args.tracking_uri,
        providers=args.providers,
        allow_cpu_fallback=args.allow_cpu_fallback,
        force=args.force,
        threads=args.threads,
        trt_cache=args.trt_cache,
        trt_fp16=args.trt_fp16,
    )


def _rows(runner: Runner, inputs: list[str], batch_size: int) -> tuple[int, int, Iterator[Prediction]]:
    """How many rows predict writes, how many of them are skipped entries, and the rows: one per entry found,
    the skipped ones (a FIFO, a broken link, an input matching nothing) first, then every regular file scored
    (``serving.files.score_files``: one poison file is its own error row and never ends the run)."""
    entries = list_inputs(inputs)
    files = [p for p, why in entries if not why]
    rows = itertools.chain((skipped(p, why) for p, why in entries if why), score_files(runner, files, batch_size))
    return len(entries), len(entries) - len(files), rows


def cmd_predict(args: argparse.Namespace) -> int:
    runner = _runner(args)
    total, skips, rows = _rows(runner, args.inputs, args.batch_size)
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
                "threshold",
                "decision",
                "reason",
                "model",
                "model_version",
                "latency_ms",
                "error",
            ]
        )
    if tqdm is not None and args.out:
        rows = tqdm(rows, total=total, unit="img")
    errors = -skips  # the skipped entries' rows carry their reason as an error
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
                    "" if r.threshold is None else r.threshold,
                    r.decision or "",
                    r.reason,
                    r.model,
                    r.model_version,
                    f"{r.latency_ms:.2f}",
                    r.error,
                ]
            )
        else:
            out.write(json.dumps(dataclasses.asdict(r)) + "\n")
    if args.out:
        out.close()
    also = f", {skips} skipped" if skips else ""
    print(f"scored {total - errors - skips} of {total} files ({errors} unreadable{also})", file=sys.stderr)
    if runner.warning:  # last, where a progress bar cannot hide it
        print(f"defect-runner: warning: {runner.warning}", file=sys.stderr)
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    runner = _runner(args)
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
        f"watch: {counts['done']} scored, {counts['failed']} failed, {counts['review']} sent to review, "
        f"{counts['skipped']} skipped",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # Until serve() installs its own handlers (before it loads the model), no signal may kill the process
    # uncleanly: SIGHUP is ignored, SIGTERM and SIGINT exit 0 (nothing has started yet).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: os._exit(0))
    # here, not at the top: starlette, uvicorn and prometheus-client add ~130 ms (measured) predict never uses
    from serving.server import ServerConfig, serve

    token = os.environ.get("DEFECT_RUNNER_TOKEN") or None
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip()
        except OSError as exc:
            raise RunnerError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise RunnerError(f"--token-file {args.token_file} is empty")
    cfg = ServerConfig(
        model=args.model,
        card=args.card,
        tracking_uri=args.tracking_uri,
        providers=args.providers,
        allow_cpu_fallback=args.allow_cpu_fallback,
        force=args.force,
        threads=args.threads,
        trt_cache=args.trt_cache,
        trt_fp16=args.trt_fp16,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_queue_delay_ms=args.max_queue_delay_ms,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_request_pixels=args.max_request_pixels,
        request_memory_bytes=None if args.request_memory_mb is None else int(args.request_memory_mb * 1024 * 1024),
        max_request_seconds=args.max_request_seconds,
        max_header_bytes=args.max_header_kb * 1024,
        max_headers=args.max_headers,
        max_connections=args.max_connections,
        token=token,
        review_dir=args.review_dir,
        review_rule=ReviewRule(args.review_margin, args.review_min_confidence),
        graceful_timeout_s=args.graceful_timeout,
    )
    serve(cfg)
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
    _add_review_args(w)
    w.add_argument("--batch-size", type=int, default=16)
    w.add_argument("--once", action="store_true", help="score what is in the inbox, then exit")
    w.set_defaults(func=cmd_watch)

    s = sub.add_parser(
        "serve",
        help="HTTP server: KServe v2 inference, an image endpoint, Prometheus /metrics",
        description="Loads and warms up the model, then serves the KServe v2 / Open Inference Protocol "
        "(/v2/health/live, /v2/health/ready, /v2/models/NAME, /v2/models/NAME/infer), "
        "POST /v2/models/NAME/classify (an encoded image, raw or multipart -> the decision) and /metrics. "
        "Concurrent requests are batched. SIGHUP or POST /v2/repository/models/NAME/load reloads the model "
        "(same source: a replaced file, or where the registry alias points now) without dropping requests; "
        "SIGTERM finishes the requests in flight and exits. Bearer token: $DEFECT_RUNNER_TOKEN or --token-file.",
    )
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this box only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--max-batch-size", type=int, default=16, help="most images per model call (default 16)")
    s.add_argument(
        "--max-queue-delay-ms", type=float, default=5.0, help="how long a request may wait for others (default 5)"
    )
    s.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body accepted (default 16)")
    _add_bounds_args(s)
    s.add_argument("--token-file", help="file holding the bearer token (else $DEFECT_RUNNER_TOKEN; none: open)")
    s.add_argument("--review-dir", help="copy unsure images sent to /classify here, as review/<class>/")
    _add_review_args(s)
    s.add_argument("--graceful-timeout", type=float, default=30.0, help="seconds to finish requests at SIGTERM")
    s.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (RunnerError, CardError, RegistryError) as exc:
        print(f"defect-runner: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
