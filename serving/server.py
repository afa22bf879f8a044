"""``defect-runner serve``: the runner over HTTP, KServe v2 / Open Inference Protocol plus an image endpoint.

Lifecycle (as in KServe's model server): load -> verify the card -> warm up -> bind the port -> ready.

  GET  /v2/health/live                       200 while the process runs
  GET  /v2/health/ready                      200 once the model is loaded and warmed up
  GET  /v2                                   server metadata (name, version, extensions)
  GET  /v2/models/{name}[/versions/{v}]      model metadata: input/output tensors, classes, threshold,
                                             the card's operating point (when it has one)
  GET  /v2/models/{name}[/versions/{v}]/ready
  POST /v2/models/{name}[/versions/{v}]/infer     v2 tensors in (JSON or binary extension); out: probs,
                                             defect_score, class, decision, reason; threshold in parameters
  POST /v2/models/{name}/classify            an encoded image (raw body or multipart) -> the decision
  POST /v2/repository/models/{name}/load     hot reload: load the model source again (also: SIGHUP)
  GET  /metrics                              Prometheus

Both scoring endpoints name the card's threshold and the rule that decided (``serving.runner.verdict``):
/classify answers ``defect_score``, ``threshold``, ``decision``, ``class`` and ``reason`` (e.g. ``defect
score 0.310 >= the card's threshold 0.070 -> defect, although the most likely class is ok``) with
``model_name`` and ``model_version``; /infer returns the same per image as the tensors ``defect_score``,
``class``, ``decision`` and ``reason`` (v2 BYTES), and the threshold, OK class and rule as the response's
``parameters``. A defect-type sorting card (no OK class, no threshold) answers the same fields: the decision
is the most likely class, ``defect_score`` its probability, ``threshold`` null in /classify, and /infer's
parameters are ``decision_rule`` (``SORTING_RULE``) and ``sorting: true``, with no threshold or OK class.
The Prometheus counter ``defect_runner_images`` counts images by decision: defect and ok, or each class.

Concurrent requests are batched (serving.batcher). Every malformed request gets a 4xx with a JSON
``{"error": ...}`` naming what was wrong; the server keeps serving. With a token (``DEFECT_RUNNER_TOKEN``
or ``--token-file``) every endpoint except health and metrics needs ``Authorization: Bearer <token>``.
SIGTERM stops accepting connections, finishes the requests in flight, then exits.

Bounds (README, *Bounds*): a request's declared image size is checked against the per-request budget
(``Runner.budget``: pixels, and tiles for a tile model) from the image header before decoding, and a
tensor's declared shape before allocating: over it, 413 naming the limit and the value. Decoding and JSON
parsing reserve their measured peak memory in a pool first (``serving.limits``); a model with tiles runs
large photographs one run of tiles at a time, taking turns with small requests (``serving.batcher``);
each request has ``max_request_seconds``, after which it is answered 503 with Retry-After (its body not
received by then: 408). uvicorn runs its h11 parser with a header size limit (httptools has none), the
server refuses more than ``max_headers`` headers (431) and caps connections. Signal handlers are
installed before the model loads: SIGTERM or SIGINT during loading exits 0 at once, SIGHUP queues one
reload for when the server is ready. A client gone mid-body is a one-line 499 in the log and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from serving import __version__
from serving.batcher import Batcher, Overloaded
from serving.card import ModelCard
from serving.limits import (
    LARGE_BODIES,
    MB,
    MIN_JSON_BYTES,
    SMALL_BODY,
    SMALL_RESERVE,
    MemoryPool,
    Slots,
    json_containers,
    json_parse_bytes,
    max_json_bytes,
)
from serving.preprocess import (
    DECODE_BYTES_PER_PIXEL,
    DEFAULT_MAX_PIXELS,
    ImageDecodeError,
    ImageTooLarge,
    decode_bytes_per_pixel,
    probe_image,
)
from serving.prometheus import Metrics
from serving.protocol import (
    InferRequest,
    ProtocolError,
    TensorSpec,
    decompress,
    infer_response,
    parse_infer_request,
    split_body,
)
from serving.review import ReviewQueue, ReviewRule
from serving.runner import TILE_CHUNK, Runner, RunnerError, open_runner

log = logging.getLogger(__name__)

OUTPUTS = ["probs", "defect_score", "class", "decision", "reason"]  # /infer's, in this order
DECISION_RULE = "decision is defect when defect_score >= threshold (the model card's), else ok"
SORTING_RULE = (
    "decision is the most likely class, defect_score its probability (defect-type sorting: no OK class, no threshold)"
)
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready", "/metrics")


@dataclass(frozen=True)
class ServerConfig:
    model: str  # a .onnx path or models:/NAME@ALIAS
    card: str | None = None
    tracking_uri: str | None = None
    providers: str = "auto"
    allow_cpu_fallback: bool = False
    force: bool = False
    threads: int = 0
    trt_cache: str | None = None
    trt_fp16: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch_size: int = 16
    max_queue_delay_ms: float = 5.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_request_pixels: int = DEFAULT_MAX_PIXELS  # declared pixels of one request (its tile budget follows)
    request_memory_bytes: int | None = None  # the pool decoding and parsing share (None: see pool_bytes)
    max_request_seconds: float = 30.0  # then 503 + Retry-After (408 while its body is still arriving)
    max_header_bytes: int = 64 * 1024  # request line + headers (h11's incomplete event size)
    max_headers: int = 100  # more: 431
    max_connections: int = 128  # concurrent connections (uvicorn's limit_concurrency; more: 503)
    token: str | None = None
    review_dir: str | None = None
    review_rule: ReviewRule = field(default_factory=ReviewRule)
    graceful_timeout_s: float = 30.0

    def pool_bytes(self) -> int:
        """The memory pool: what one request of ``max_request_pixels`` needs to decode, plus the reserve
        that keeps small requests flowing beside it (unless ``request_memory_bytes`` says otherwise)."""
        if self.request_memory_bytes is not None:
            return self.request_memory_bytes
        return self.max_request_pixels * DECODE_BYTES_PER_PIXEL + SMALL_RESERVE


class ModelHolder:
    """The model being served, swapped atomically on reload; in-flight batches finish on the old one."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.runner = self._load()
        self.name = self.runner.card.name
        self.reload_lock = asyncio.Lock()

    def _load(self) -> Runner:
        cfg = self.cfg
        return open_runner(
            cfg.model,
            cfg.card,
            cfg.tracking_uri,
            providers=cfg.providers,
            allow_cpu_fallback=cfg.allow_cpu_fallback,
            force=cfg.force,
            threads=cfg.threads,
            trt_cache=cfg.trt_cache,
            trt_fp16=cfg.trt_fp16,
            warmup_batch_sizes=tuple(sorted({1, cfg.max_batch_size})),
        )

    def infer(self, batch: np.ndarray):
        """The model call as steps (``Runner.predict_steps``) for the batcher: (outputs by name, runner)."""
        runner = self.runner  # one reference for the whole call: a reload cannot change it midway
        probs, score = yield from runner.predict_steps(batch)
        return {"probs": probs, "defect_score": score}, runner

    def cost(self, batch: np.ndarray) -> int:
        """A request's work for the batcher's lanes: tiles for a model with tiles, else images."""
        return self.runner.budget().cost(*batch.shape[:3])

    async def reload(self) -> tuple[str, str]:
        """Load the model source again (a new file, or wherever the registry alias points now)."""
        async with self.reload_lock:
            new = await run_in_threadpool(self._load)
            if new.card.name != self.name:
                raise RunnerError(f"the new model is named {new.card.name!r}, this server serves {self.name!r}")
            old, self.runner = self.runner, new
            return old.version, new.version


def input_spec(runner: Runner) -> TensorSpec:
    return TensorSpec(runner.input_name, "UINT8", (-1, *runner.input_shape))


def model_metadata(runner: Runner) -> dict[str, Any]:
    card = runner.card
    k = len(card.classes)
    return {
        "name": card.name,
        "versions": [runner.version],
        "platform": "onnxruntime_onnx",
        "inputs": [input_spec(runner).metadata()],
        "outputs": [
            {"name": "probs", "datatype": "FP32", "shape": [-1, k]},
            {"name": "defect_score", "datatype": "FP32", "shape": [-1]},
            {"name": "class", "datatype": "BYTES", "shape": [-1]},
            {"name": "decision", "datatype": "BYTES", "shape": [-1]},
            {"name": "reason", "datatype": "BYTES", "shape": [-1]},
        ],
        "parameters": {
            "classes": card.classes,
            **decision_parameters(card),
            "variant": card.variant,
            "architecture": card.architecture,
            "resize": card.input.resize,
            "providers": runner.providers,
            **tile_parameters(card),
            **({"operating_point": card.operating_point} if card.operating_point else {}),
        },
    }


def decision_parameters(card: ModelCard) -> dict[str, Any]:
    """How the card decides, as v2 parameters: its threshold, OK class and rule; for a sorting card the rule
    alone and ``sorting: true`` (v2 parameter values are never null)."""
    if card.sorting:
        return {"decision_rule": SORTING_RULE, "sorting": True}
    return {"threshold": card.threshold, "ok_class": card.ok_class, "decision_rule": DECISION_RULE}


def tile_parameters(card: ModelCard) -> dict[str, Any]:
    """For a card with tiles: the tile model's network, tile side and share of the fused probabilities."""
    if card.tiles is None:
        return {}
    t = card.tiles
    return {"tile_architecture": t.architecture, "tile_size": t.size, "tile_weight": t.weight}


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


IMAGE_MAGIC = [
    (b"\x89PNG", ".png"),
    (b"\xff\xd8", ".jpg"),
    (b"BM", ".bmp"),
    (b"II*\x00", ".tif"),
    (b"MM\x00*", ".tif"),
    (b"GIF8", ".gif"),
]


def image_suffix(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    return next((ext for magic, ext in IMAGE_MAGIC if data.startswith(magic)), ".img")


# Endpoint label for metrics: the route, never the raw path (a scan of random URLs must not create
# thousands of time series).
ENDPOINTS = [
    (re.compile(r"^/v2/health/(live|ready)$"), "health"),
    (re.compile(r"^/v2/models/[^/]+(/versions/[^/]+)?/infer$"), "infer"),
    (re.compile(r"^/v2/models/[^/]+/classify$"), "classify"),
    (re.compile(r"^/v2/repository/models/[^/]+/load$"), "reload"),
    (re.compile(r"^/v2(/models/[^/]+(/versions/[^/]+)?(/ready)?)?$"), "metadata"),
    (re.compile(r"^/metrics$"), "metrics"),
]


def endpoint_of(path: str) -> str:
    return next((name for rx, name in ENDPOINTS if rx.match(path)), "other")


class Guard:
    """Pure ASGI middleware: header count limit, bearer token check, request metrics, in-flight gauge."""

    def __init__(self, app, metrics: Metrics, token: str | None, max_headers: int = 100) -> None:
        self.app, self.metrics, self.token, self.max_headers = app, metrics, token, max_headers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, started, status = scope["path"], time.perf_counter(), [500, False]

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[:] = [message["status"], True]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            if len(scope["headers"]) > self.max_headers:
                response = error(431, f"{len(scope['headers'])} headers exceed the limit of {self.max_headers}")
                await response(scope, receive, send_and_record)
            elif self.token and path not in OPEN_PATHS and not self._authorized(scope):
                response = error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
        except Exception:
            # Starlette re-raises what its 500 handler (``unexpected``) already answered and logged: a
            # second traceback from uvicorn would say nothing new.
            if not status[1]:
                raise
        finally:
            self.metrics.in_flight.dec()
            endpoint = endpoint_of(path)
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            if endpoint in ("infer", "classify"):
                self.metrics.phase.labels("total").observe(time.perf_counter() - started)

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, given = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())


class StartupSignals:
    """Signal handlers from the first moment of ``serve``, before the model loads (a TensorRT engine build
    can take minutes): SIGTERM or SIGINT while loading exits 0 at once with a log line; SIGHUP before the
    server is ready queues one reload, run once it is (the lifespan). Once serving, uvicorn handles SIGINT
    and SIGTERM (and re-raises them here after its graceful shutdown: then they do nothing)."""

    def __init__(self) -> None:
        self.serving = False
        self.reload_queued = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            if not self.reload_queued:
                log.info("%s before the server is ready: one reload queued for when it is", name)
            self.reload_queued = True
        elif not self.serving:
            log.info("%s while the model loads: exiting before serving", name)
            os._exit(0)  # the loading thread may be inside onnxruntime for minutes: nothing to finish


def load_model(cfg: ServerConfig) -> ModelHolder:
    """``ModelHolder(cfg)`` in a thread, so the main thread stays free to run signal handlers meanwhile."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["holder"] = ModelHolder(cfg)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the main thread below)
            result["error"] = exc

    thread = threading.Thread(target=work, name="load-model", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)  # short waits: Python runs signal handlers between them
    if "error" in result:
        raise result["error"]
    return result["holder"]


class V2Endpoints:
    """The HTTP handlers, one method per route (as KServe's ``V2Endpoints``); routes in ``register_v2_endpoints``.

    Owns what the handlers share: the model holder, the batcher that groups concurrent requests into
    one model call, the memory pool and body slots every request's heavy phases go through, the
    Prometheus metrics and, with ``cfg.review_dir``, the review queue.
    """

    def __init__(
        self, holder: ModelHolder, cfg: ServerConfig, metrics: Metrics, signals: StartupSignals | None = None
    ) -> None:
        self.holder, self.cfg, self.metrics, self.signals = holder, cfg, metrics, signals
        tiles = holder.runner.card.tiles is not None
        self.batcher = Batcher(
            holder.infer,
            cfg.max_batch_size,
            cfg.max_queue_delay_ms / 1000,
            on_batch=lambda n, _s: metrics.batch_size.observe(n),
            cost=holder.cost,
            max_batch_cost=TILE_CHUNK if tiles else cfg.max_batch_size,
        )
        self.pool = MemoryPool(cfg.pool_bytes())
        self.bodies = Slots(LARGE_BODIES)
        self.parsing = asyncio.Semaphore(1)  # json.loads holds the GIL: one at a time loses nothing
        self.queue = ReviewQueue(Path(cfg.review_dir)) if cfg.review_dir else None
        self.publish_model()
        if self.queue:
            metrics.review_queue_size.set(self.queue.count())

    def publish_model(self) -> None:
        r = self.holder.runner
        self.metrics.set_model(r.card.name, r.version, r.card.variant, r.providers[0])

    @contextlib.asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        """Start the batcher and the SIGHUP reload (and one queued during loading); at shutdown, finish
        the batches in hand."""
        self.batcher.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not in the main thread
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.do_reload()))
        if self.signals is not None:
            self.signals.serving = True
            if self.signals.reload_queued:
                loop.create_task(self.do_reload())
        cfg, runner = self.cfg, self.holder.runner
        log.info(
            "serving %s version %s on %s (max batch %d, queue delay %.1f ms, request memory %d MB, %d px, %.0f s)",
            self.holder.name,
            runner.version,
            runner.providers,
            cfg.max_batch_size,
            cfg.max_queue_delay_ms,
            self.pool.capacity // MB,
            cfg.max_request_pixels,
            cfg.max_request_seconds,
        )
        yield
        await self.batcher.stop()

    # --- request helpers ---------------------------------------------------------------------------
    def runner_for(self, request: Request) -> Runner:
        """The runner serving the request's model name (and version, when the path names one), else 404."""
        runner, served = self.holder.runner, self.holder.name
        name, version = request.path_params["name"], request.path_params.get("version")
        if name != served:
            raise ProtocolError(f"unknown model {name!r}: this server serves {served!r}", 404)
        if version is not None and version != runner.version:
            raise ProtocolError(f"model {name!r} has no version {version!r} (serving {runner.version!r})", 404)
        return runner

    def deadline(self) -> float:
        return time.perf_counter() + self.cfg.max_request_seconds

    async def reserve(self, hold: contextlib.AsyncExitStack, n: int, deadline: float, what: str) -> None:
        """Hold ``n`` bytes of the memory pool until ``hold`` closes; 413 when the pool could never hold it."""
        if not self.pool.fits_ever(n):
            raise ProtocolError(
                f"{what} needs {n / MB:.0f} MB, more than the {self.pool.limit_for(n) / MB:.0f} MB of request "
                "memory a large request may use (serve --request-memory-mb)",
                413,
            )
        await hold.enter_async_context(self.pool.hold(n, deadline, what))

    async def read_body(self, request: Request, hold: contextlib.AsyncExitStack, deadline: float) -> bytes:
        """The whole body, refused with 413 once it exceeds ``cfg.max_body_bytes``; a body over
        ``SMALL_BODY`` waits for one of ``LARGE_BODIES`` slots, held until ``hold`` closes. A body not
        received by the deadline is a 408."""
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ProtocolError(f"header Content-Length must be a number, got {declared!r}")
            if int(declared) > limit:
                raise ProtocolError(f"body of {declared} bytes exceeds the limit of {limit} bytes", 413)
            if int(declared) > SMALL_BODY:
                await hold.enter_async_context(self.bodies.hold(deadline, f"a body of {declared} bytes"))
        chunks, size, slotted = [], 0, declared is not None and int(declared) > SMALL_BODY
        try:
            async with asyncio.timeout(max(deadline - time.perf_counter(), 0)):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:  # chunked uploads have no Content-Length: count as they come
                        raise ProtocolError(f"body exceeds the limit of {limit} bytes", 413)
                    if size > SMALL_BODY and not slotted:
                        await hold.enter_async_context(self.bodies.hold(deadline, "a chunked body over 1 MB"))
                        slotted = True
                    chunks.append(chunk)
        except TimeoutError:
            raise ProtocolError(
                f"body not received within the request's {self.cfg.max_request_seconds:.0f} s ({size} bytes came)",
                408,
            ) from None
        return b"".join(chunks)

    async def image_from(self, request: Request, hold, deadline: float) -> tuple[bytes, str]:
        """The encoded image and its client-side filename: a raw image body or a multipart file field."""
        body = await self.read_body(request, hold, deadline)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "multipart/form-data":

            async def once() -> AsyncIterator[bytes]:
                yield body

            try:
                form = await MultiPartParser(request.headers, once(), max_files=1, max_fields=10).parse()
            except MultiPartException as exc:
                raise ProtocolError(f"malformed multipart body: {exc.message}") from None
            uploads = [v for _, v in form.multi_items() if hasattr(v, "read")]
            if not uploads:
                raise ProtocolError("multipart body has no file part: send the image as a file field (e.g. 'image')")
            data = await uploads[0].read()
            return data, uploads[0].filename or ""
        if ctype and not (ctype.startswith("image/") or ctype == "application/octet-stream"):
            raise ProtocolError(
                f"Content-Type {ctype!r} is not an image: send image/* or application/octet-stream bytes, "
                "or multipart/form-data with a file field",
                415,
            )
        return body, request.query_params.get("filename", "")

    async def decode(self, runner: Runner, data: bytes, hold, deadline: float) -> tuple[np.ndarray, float]:
        """Image bytes -> (H, W, C) uint8 pixels (the model input, or with tiles the full photograph), seconds.

        The header's declared size is checked against the budget first (nothing decoded yet), then the
        decode's measured peak memory is reserved in the pool, then the image is decoded."""
        t0 = time.perf_counter()
        budget = runner.budget(self.cfg.max_request_pixels)
        try:
            width, height, fmt = await run_in_threadpool(probe_image, data, budget.pixels)
            budget.check_image(width, height)
        except ImageDecodeError as exc:
            raise image_error(exc) from None
        need = width * height * decode_bytes_per_pixel(fmt)
        await self.reserve(hold, need, deadline, f"decoding a {width}x{height} {fmt} image")
        try:
            img = await run_in_threadpool(runner.load, data, budget.pixels)
        except ImageDecodeError as exc:
            raise image_error(exc) from None
        decode_s = time.perf_counter() - t0
        self.metrics.phase.labels("decode").observe(decode_s)
        return img, decode_s

    async def parse(self, request: Request, runner: Runner, body: bytes, hold, deadline: float) -> InferRequest:
        """A v2 infer body -> the request, its tensor checked against the budget before it is allocated.

        Inflating and parsing run in a worker thread (one JSON parse at a time), each after reserving its
        estimated peak memory in the pool, so a 16 MB body of nested lists waits its turn instead of
        holding the event loop or many times its size in memory at once."""
        cfg = self.cfg
        encoding = request.headers.get("content-encoding")
        if encoding and encoding != "identity":
            await self.reserve(hold, cfg.max_body_bytes, deadline, f"inflating a {encoding} body")
            body = await run_in_threadpool(decompress, body, encoding, cfg.max_body_bytes)
        length = request.headers.get("inference-header-content-length")
        json_part = body if length is None or not length.isdigit() else body[: int(length)]
        self.check_json_size(runner, json_part)
        await self.reserve(hold, json_parse_bytes(json_part), deadline, f"parsing a {len(json_part)} byte JSON body")
        spec, check = input_spec(runner), self.shape_check(runner)

        def work() -> InferRequest:
            header, tail = split_body(body, length)
            return parse_infer_request(header, tail, spec, OUTPUTS, cfg.max_batch_size, check)

        async with self.parsing:
            return await run_in_threadpool(work)

    def check_json_size(self, runner: Runner, text: bytes) -> None:
        """Refuse a JSON part longer, or nesting more lists, than this model's largest input takes as JSON
        (``serving.limits``: parsing holds the GIL). With tiles (photographs of any size) the floor of
        MIN_JSON_BYTES: large photographs come as binary tensor data or images."""
        values, lists = 0, MIN_JSON_BYTES  # tiles: the byte cap alone bounds the lists
        if runner.card.tiles is None:
            size, _, channels = runner.input_shape
            values = self.cfg.max_batch_size * size * size * channels
            lists = self.cfg.max_batch_size * (size * size + size + 1) + 64  # (N, H, W, C) nested row by row
        cap = max_json_bytes(values)
        if len(text) > cap:
            raise ProtocolError(
                f"the JSON part of {len(text)} bytes exceeds the limit of {cap} bytes (this model's largest "
                "tensor as JSON numbers): send tensor data with the binary extension (parameters.binary_data_size)",
                413,
            )
        if (found := json_containers(text)) > lists:
            raise ProtocolError(
                f"the JSON part nests {found} lists and objects, more than the {lists} of this model's largest "
                "tensor written row by row"
            )

    def shape_check(self, runner: Runner):
        """The per-request budget as ``parse_infer_request``'s ``check_shape``: 413 over it."""
        budget = runner.budget(self.cfg.max_request_pixels)

        def check(shape: tuple[int, ...]) -> None:
            try:
                budget.check(shape[0], shape[1], shape[2], what="input")
            except ImageTooLarge as exc:
                raise ProtocolError(str(exc), 413) from None

        return check

    async def run_batch(self, submit, x: np.ndarray, deadline: float):
        """Score ``x`` (N, ...) in the next batch (or, large, in turns); record its queue and inference time."""
        try:
            res = await submit(x, deadline)
        except ValueError as exc:  # a reload changed the input shape while the request waited
            raise ProtocolError(f"the model changed while the request waited ({exc}); send it again", 409) from None
        self.metrics.phase.labels("queue").observe(res.queue_s)
        self.metrics.phase.labels("inference").observe(res.infer_s)
        return res

    # --- health and metadata -----------------------------------------------------------------------
    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        ok = self.holder.runner.ready
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse(
            {"name": "defect-runner", "version": __version__, "extensions": ["binary_tensor_data", "model_repository"]}
        )

    async def model_meta(self, request: Request) -> Response:
        return JSONResponse(model_metadata(self.runner_for(request)))

    async def model_ready(self, request: Request) -> Response:
        runner = self.runner_for(request)
        return JSONResponse({"name": self.holder.name, "ready": runner.ready}, status_code=200 if runner.ready else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # --- inference ---------------------------------------------------------------------------------
    async def infer(self, request: Request) -> Response:
        """v2 tensors in (JSON or the binary extension); out, in the same form, the model's probabilities and
        defect scores with each image's class, decision and reason, and the card's threshold as a parameter."""
        runner, deadline = self.runner_for(request), self.deadline()
        async with contextlib.AsyncExitStack() as hold, self.batcher.slot() as submit:
            body = await self.read_body(request, hold, deadline)
            req = await self.parse(request, runner, body, hold, deadline)
            del body
            res = await self.run_batch(submit, req.tensor, deadline)
        used: Runner = res.tag
        probs, scores = res.outputs["probs"], res.outputs["defect_score"]
        decided = [used.decide(p, float(s)) for p, s in zip(probs, scores, strict=True)]  # (class, decision, reason)
        decisions = [d for _, d, _ in decided]
        for d in used.card.decisions:
            self.metrics.images.labels(d).inc(decisions.count(d))
        strings = {"class": [c for c, _, _ in decided], "decision": decisions, "reason": [r for _, _, r in decided]}
        outputs = res.outputs | {k: np.array(v, dtype=object) for k, v in strings.items()}
        parameters = decision_parameters(used.card)
        content, header_len = infer_response(self.holder.name, used.version, req, outputs, parameters)
        if header_len is None:
            return Response(content, media_type="application/json")
        return Response(
            content,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(header_len)},
        )

    async def classify(self, request: Request) -> Response:
        """An encoded image in, the decision out; unsure images are copied to the review queue."""
        runner, deadline = self.runner_for(request), self.deadline()
        async with contextlib.AsyncExitStack() as hold, self.batcher.slot() as submit:
            data, filename = await self.image_from(request, hold, deadline)
            if not data:
                raise ProtocolError("empty image: the request carried no image bytes")
            img, decode_s = await self.decode(runner, data, hold, deadline)
            res = await self.run_batch(submit, img[None], deadline)
            del img
        used: Runner = res.tag
        p, score = res.outputs["probs"][0], float(res.outputs["defect_score"][0])
        label, decision, reason = used.decide(p, score)
        probs = dict(zip(used.card.classes, map(float, p), strict=True))
        self.metrics.images.labels(decision).inc()
        reasons = self.cfg.review_rule.reasons(score, probs, used.card.threshold)
        result = {
            "model_name": self.holder.name,
            "model_version": used.version,
            "class": label,
            "probabilities": probs,
            "defect_score": score,
            "threshold": used.card.threshold,
            "decision": decision,
            "reason": reason,
            "review_reasons": reasons,
            "timing_ms": {
                "decode": round(decode_s * 1000, 3),
                "queue": round(res.queue_s * 1000, 3),
                "inference": round(res.infer_s * 1000, 3),
                "batch_size": res.batch_size,
            },
        }
        if self.queue and reasons:
            await self.send_to_review(data, filename, result)
        return JSONResponse(result)

    async def send_to_review(self, data: bytes, filename: str, result: dict[str, Any]) -> None:
        """Copy the image to review/<class>/ under a unique timestamped name, with its result row."""
        stem = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
        name = stem + image_suffix(data)
        row = {k: v for k, v in result.items() if k not in ("review_reasons", "timing_ms")}  # the queue adds its own
        row["filename"] = filename
        await run_in_threadpool(self.queue.add, data, name, result["class"], row, result["review_reasons"])
        self.metrics.review_queued.inc()
        self.metrics.review_queue_size.inc()

    # --- model repository --------------------------------------------------------------------------
    async def reload(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.holder.name:
            raise ProtocolError(f"unknown model {name!r}: this server serves {self.holder.name!r}", 404)
        async with contextlib.AsyncExitStack() as hold:  # the body is accepted and ignored: the model source
            await self.read_body(request, hold, self.deadline())  # is the one the server started with
        return await self.do_reload()

    async def do_reload(self) -> Response:
        """Load the model source again; on any failure the old model keeps serving (422)."""
        holder = self.holder
        try:
            old, new = await holder.reload()
        except Exception as exc:  # noqa: BLE001 (any failure to load leaves the old model serving)
            self.metrics.reloads.labels("failed").inc()
            log.error("reload failed, still serving version %s: %s", holder.runner.version, exc)
            return error(422, f"reload failed, still serving version {holder.runner.version}: {exc}")
        self.metrics.reloads.labels("ok").inc()
        self.publish_model()
        log.info("reloaded %s: version %s -> %s", holder.name, old, new)
        return JSONResponse({"name": holder.name, "previous_version": old, "version": new})


def register_v2_endpoints(app: Starlette, endpoints: V2Endpoints) -> None:
    """Every route of the server, in one place (GET unless marked; see the module docstring)."""
    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    post = ["POST"]
    app.add_route("/v2/health/live", endpoints.live)
    app.add_route("/v2/health/ready", endpoints.ready)
    app.add_route("/v2", endpoints.server_metadata)
    app.add_route(model, endpoints.model_meta)
    app.add_route(versioned, endpoints.model_meta)
    app.add_route(model + "/ready", endpoints.model_ready)
    app.add_route(versioned + "/ready", endpoints.model_ready)
    app.add_route(model + "/infer", endpoints.infer, methods=post)
    app.add_route(versioned + "/infer", endpoints.infer, methods=post)
    app.add_route(model + "/classify", endpoints.classify, methods=post)
    app.add_route("/v2/repository/models/{name}/load", endpoints.reload, methods=post)
    app.add_route("/metrics", endpoints.prometheus)


# --- errors: always JSON, always 4xx for the client's mistakes -------------------------------------
async def protocol_error(request: Request, exc: ProtocolError) -> Response:
    return error(exc.status, str(exc))


def image_error(exc: ImageDecodeError) -> ProtocolError:
    """An image the server cannot take: 413 over a limit, else 400, with the decoder's reason."""
    return ProtocolError(str(exc).replace("<bytes>", "image"), 413 if isinstance(exc, ImageTooLarge) else 400)


async def overloaded(request: Request, exc: Overloaded) -> Response:
    """Out of time or memory for now: 503 with Retry-After, the client may send it again later."""
    log.warning("503 on %s: %s", request.url.path, exc)
    response = error(503, f"{exc}; retry after {exc.retry_after} s")
    response.headers["Retry-After"] = str(exc.retry_after)
    return response


async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client closed the connection before its body arrived: its doing, one log line, code 499 in the
    metrics (nginx's "client closed request"; nobody is left to read it)."""
    log.info("client disconnected mid-body on %s %s", request.method, request.url.path)
    return Response(status_code=499)


async def http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.url.path!r}", 405: f"method {request.method} not allowed here"}
    return error(exc.status_code, message.get(exc.status_code, exc.detail))


async def unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error(500, f"internal error ({type(exc).__name__}); the server logged the details")


EXCEPTION_HANDLERS = {
    ProtocolError: protocol_error,
    Overloaded: overloaded,
    ClientDisconnect: client_gone,
    HTTPException: http_error,
    Exception: unexpected,
}


def create_app(
    holder: ModelHolder, cfg: ServerConfig, metrics: Metrics | None = None, signals: StartupSignals | None = None
) -> Guard:
    """The ASGI app: the v2 endpoints, behind the header limit, bearer-token check and request metrics."""
    endpoints = V2Endpoints(holder, cfg, metrics or Metrics(), signals)
    app = Starlette(exception_handlers=EXCEPTION_HANDLERS, lifespan=endpoints.lifespan)
    register_v2_endpoints(app, endpoints)
    app.state.batcher, app.state.metrics, app.state.holder = endpoints.batcher, endpoints.metrics, holder
    return Guard(app, endpoints.metrics, cfg.token, cfg.max_headers)


def serve(cfg: ServerConfig) -> None:
    """Load and warm up the model, then serve until SIGINT/SIGTERM (finishing in-flight requests).

    The signal handlers come first (``StartupSignals``), so no moment of the load is unguarded."""
    signals = StartupSignals()
    signals.install()
    log.info("loading %s (until ready: SIGTERM exits, SIGHUP queues a reload)", cfg.model)
    holder = load_model(cfg)
    app = create_app(holder, cfg, signals=signals)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.token:
        log.warning("listening on %s without a bearer token: anyone who can reach the port can call it", cfg.host)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        access_log=False,
        log_level="info",
        timeout_graceful_shutdown=int(cfg.graceful_timeout_s),
        lifespan="on",
        http="h11",  # httptools (uvicorn's default when installed) has no header size limit
        h11_max_incomplete_event_size=cfg.max_header_bytes,
        limit_concurrency=cfg.max_connections,
    )
    # uvicorn restores the signal handlers it found (``signals``'s) and re-raises the signal it caught once
    # it has shut down gracefully; with Python's defaults that would kill the process (exit -15 / 143) after
    # a clean shutdown. Once serving, ``signals`` does nothing with SIGTERM/SIGINT, so SIGTERM exits 0.
    uvicorn.Server(config).run()


__all__ = ["ModelHolder", "ServerConfig", "create_app", "serve"]
