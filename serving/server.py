"""``defect-runner serve``: the runner over HTTP, KServe v2 / Open Inference Protocol plus an image endpoint.

Lifecycle (as in KServe's model server): load -> verify the card -> warm up -> bind the port -> ready.

  GET  /v2/health/live                       200 while the process runs
  GET  /v2/health/ready                      200 once the model is loaded and warmed up
  GET  /v2                                   server metadata (name, version, extensions)
  GET  /v2/models/{name}[/versions/{v}]      model metadata: input/output tensors, classes, threshold
  GET  /v2/models/{name}[/versions/{v}]/ready
  POST /v2/models/{name}[/versions/{v}]/infer     v2 tensors in (JSON or binary extension), probs out
  POST /v2/models/{name}/classify            an encoded image (raw body or multipart) -> the decision
  POST /v2/repository/models/{name}/load     hot reload: load the model source again (also: SIGHUP)
  GET  /metrics                              Prometheus

Concurrent requests are batched (serving.batcher). Every malformed request gets a 4xx with a JSON
``{"error": ...}`` naming what was wrong; the server keeps serving. With a token (``DEFECT_RUNNER_TOKEN``
or ``--token-file``) every endpoint except health and metrics needs ``Authorization: Bearer <token>``.
SIGTERM stops accepting connections, finishes the requests in flight, then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import signal
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
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving import __version__
from serving.batcher import Batcher
from serving.card import ModelCard
from serving.preprocess import DEFAULT_MAX_PIXELS, ImageDecodeError
from serving.prometheus import Metrics
from serving.protocol import (
    ProtocolError,
    TensorSpec,
    decompress,
    infer_response,
    parse_infer_request,
    split_body,
)
from serving.review import ReviewQueue, ReviewRule
from serving.runner import Runner, RunnerError, open_runner

log = logging.getLogger(__name__)

OUTPUTS = ["probs", "defect_score"]
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
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    token: str | None = None
    review_dir: str | None = None
    review_rule: ReviewRule = field(default_factory=ReviewRule)
    graceful_timeout_s: float = 30.0


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

    def infer(self, batch: np.ndarray) -> tuple[dict[str, np.ndarray], Runner]:
        runner = self.runner  # one reference for the whole call: a reload cannot change it midway
        probs, score = runner.predict(batch)
        return {"probs": probs, "defect_score": score}, runner

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
        ],
        "parameters": {
            "classes": card.classes,
            "ok_class": card.ok_class,
            "threshold": card.threshold,
            "variant": card.variant,
            "architecture": card.architecture,
            "resize": card.input.resize,
            "providers": runner.providers,
            **tile_parameters(card),
        },
    }


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
    """Pure ASGI middleware: bearer token check, request metrics, in-flight gauge."""

    def __init__(self, app, metrics: Metrics, token: str | None) -> None:
        self.app, self.metrics, self.token = app, metrics, token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, started, status = scope["path"], time.perf_counter(), [500]

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            if self.token and path not in OPEN_PATHS and not self._authorized(scope):
                response = error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send_and_record)
            else:
                await self.app(scope, receive, send_and_record)
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


class V2Endpoints:
    """The HTTP handlers, one method per route (as KServe's ``V2Endpoints``); routes in ``register_v2_endpoints``.

    Owns what the handlers share: the model holder, the batcher that groups concurrent requests into
    one model call, the Prometheus metrics and, with ``cfg.review_dir``, the review queue.
    """

    def __init__(self, holder: ModelHolder, cfg: ServerConfig, metrics: Metrics) -> None:
        self.holder, self.cfg, self.metrics = holder, cfg, metrics
        self.batcher = Batcher(
            holder.infer,
            cfg.max_batch_size,
            cfg.max_queue_delay_ms / 1000,
            on_batch=lambda n, _s: metrics.batch_size.observe(n),
        )
        self.queue = ReviewQueue(Path(cfg.review_dir)) if cfg.review_dir else None
        self.publish_model()
        if self.queue:
            metrics.review_queue_size.set(self.queue.count())

    def publish_model(self) -> None:
        r = self.holder.runner
        self.metrics.set_model(r.card.name, r.version, r.card.variant, r.providers[0])

    @contextlib.asynccontextmanager
    async def lifespan(self, app) -> AsyncIterator[None]:
        """Start the batcher and the SIGHUP reload; at shutdown, finish the batches in hand."""
        self.batcher.start()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not in the main thread
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.do_reload()))
        cfg, runner = self.cfg, self.holder.runner
        log.info(
            "serving %s version %s on %s (max batch %d, queue delay %.1f ms)",
            self.holder.name,
            runner.version,
            runner.providers,
            cfg.max_batch_size,
            cfg.max_queue_delay_ms,
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

    async def read_body(self, request: Request) -> bytes:
        """The whole body, refused with 413 once it exceeds ``cfg.max_body_bytes``."""
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ProtocolError(f"header Content-Length must be a number, got {declared!r}")
            if int(declared) > limit:
                raise ProtocolError(f"body of {declared} bytes exceeds the limit of {limit} bytes", 413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # chunked uploads have no Content-Length: count as they come
                raise ProtocolError(f"body exceeds the limit of {limit} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def image_from(self, request: Request) -> tuple[bytes, str]:
        """The encoded image and its client-side filename: a raw image body or a multipart file field."""
        body = await self.read_body(request)
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

    async def decode(self, runner: Runner, data: bytes) -> tuple[np.ndarray, float]:
        """Image bytes -> (H, W, C) uint8 pixels (the model input, or with tiles the full photograph), seconds."""
        t0 = time.perf_counter()
        try:
            img = await run_in_threadpool(runner.load, data, self.cfg.max_image_pixels)
        except ImageDecodeError as exc:
            status = 413 if "exceeds the limit" in str(exc) else 400
            raise ProtocolError(str(exc).replace("<bytes>", "image"), status) from None
        decode_s = time.perf_counter() - t0
        self.metrics.phase.labels("decode").observe(decode_s)
        return img, decode_s

    async def run_batch(self, submit, x: np.ndarray):
        """Score ``x`` (N, ...) in the next batch; record its queue and inference time."""
        try:
            res = await submit(x)
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
        """v2 tensors in (JSON or the binary extension), probs and defect scores out in the same form."""
        runner, cfg = self.runner_for(request), self.cfg
        async with self.batcher.slot() as submit:
            body = await self.read_body(request)
            body = decompress(body, request.headers.get("content-encoding"), cfg.max_body_bytes)
            header, tail = split_body(body, request.headers.get("inference-header-content-length"))
            req = parse_infer_request(header, tail, input_spec(runner), OUTPUTS, cfg.max_batch_size)
            res = await self.run_batch(submit, req.tensor)
        threshold = res.tag.card.threshold
        scores = res.outputs["defect_score"]
        self.metrics.images.labels("defect").inc(int((scores >= threshold).sum()))
        self.metrics.images.labels("ok").inc(int((scores < threshold).sum()))
        content, header_len = infer_response(self.holder.name, res.tag.version, req, res.outputs)
        if header_len is None:
            return Response(content, media_type="application/json")
        return Response(
            content,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(header_len)},
        )

    async def classify(self, request: Request) -> Response:
        """An encoded image in, the decision out; unsure images are copied to the review queue."""
        runner = self.runner_for(request)
        async with self.batcher.slot() as submit:
            data, filename = await self.image_from(request)
            if not data:
                raise ProtocolError("empty image: the request carried no image bytes")
            img, decode_s = await self.decode(runner, data)
            res = await self.run_batch(submit, img[None])
        used: Runner = res.tag
        p, score = res.outputs["probs"][0], float(res.outputs["defect_score"][0])
        label, decision = used.decide(p, score)
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
        row = {k: result[k] for k in ("class", "probabilities", "defect_score", "decision", "model_version")}
        row["filename"] = filename
        await run_in_threadpool(self.queue.add, data, name, result["class"], row, result["review_reasons"])
        self.metrics.review_queued.inc()
        self.metrics.review_queue_size.inc()

    # --- model repository --------------------------------------------------------------------------
    async def reload(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.holder.name:
            raise ProtocolError(f"unknown model {name!r}: this server serves {self.holder.name!r}", 404)
        await self.read_body(request)  # accepted and ignored: the model source is the one the server started with
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


async def http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.url.path!r}", 405: f"method {request.method} not allowed here"}
    return error(exc.status_code, message.get(exc.status_code, exc.detail))


async def unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error(500, f"internal error ({type(exc).__name__}); the server logged the details")


EXCEPTION_HANDLERS = {ProtocolError: protocol_error, HTTPException: http_error, Exception: unexpected}


def create_app(holder: ModelHolder, cfg: ServerConfig, metrics: Metrics | None = None) -> Guard:
    """The ASGI app: the v2 endpoints, behind the bearer-token check and request metrics (``Guard``)."""
    endpoints = V2Endpoints(holder, cfg, metrics or Metrics())
    app = Starlette(exception_handlers=EXCEPTION_HANDLERS, lifespan=endpoints.lifespan)
    register_v2_endpoints(app, endpoints)
    app.state.batcher, app.state.metrics, app.state.holder = endpoints.batcher, endpoints.metrics, holder
    return Guard(app, endpoints.metrics, cfg.token)


def serve(cfg: ServerConfig) -> None:
    """Load and warm up the model, then serve until SIGINT/SIGTERM (finishing in-flight requests)."""
    holder = ModelHolder(cfg)
    app = create_app(holder, cfg)
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
    )
    # uvicorn restores the signal handlers it found and re-raises the signal it caught once it has
    # shut down gracefully; with Python's defaults that would kill the process (exit -15 / 143) after a
    # clean shutdown. Handlers that do nothing make the re-raise harmless, so SIGTERM exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()


__all__ = ["ModelHolder", "ServerConfig", "create_app", "serve"]
