"""Load an exported model with its card and score images: load -> verify -> warm up -> ready -> predict.

Every scored image's result (``Prediction``: the CLI's CSV and JSONL rows, the watcher's results and review
queue lines; the server's /classify answer uses the same ``verdict``) names the one rule that decided it:

- ``defect_score`` (1 - p(ok)) and ``threshold``, the model card's, the only one the runner uses:
  ``decision`` is "defect" when ``defect_score >= threshold``, else "ok";
- ``class``/``label``: the most likely class (argmax of the probabilities), which need not agree: with a
  card threshold of 0.07, an image at p(ok) 0.69 is class "ok" with decision "defect";
- ``reason``, on every scored row, e.g. ``defect score 0.310 >= the card's threshold 0.070 -> defect,
  although the most likely class is ok``; the ``although ...`` clause appears exactly when the class and
  the decision disagree. Numbers carry as many decimals as it takes to tell them apart;
- ``model`` and ``model_version`` (the registry version, or the start of the model's sha256).

A defect-type sorting card (``ModelCard.sorting``: no OK class, no threshold) fills the same row: ``decision``
is the most likely class (the same as ``class``), ``defect_score`` is the graph's, that class's probability,
``threshold`` is None, and ``reason`` says e.g. ``most likely class scratches at p=0.934 (defect-type
sorting: no OK class, no threshold)`` (``sorting_verdict``).

A row that was not scored (an unreadable or skipped file) has no score, threshold or reason: ``error``
says why.

A model marked for review, its card's ``operating_point`` status "below target" (the evaluate stage could not
reach the recall target under the false-alarm ceiling; export then also marks it not deployable, so that
promotion and the recommended variant pass it by), still loads and runs: a person may choose to run it. A
card not deployable for another reason (a variant that failed export's parity gate: its scores are not the
model's) is refused unless ``force``. Either way a loaded model that is not deployable or below target gets a
loud warning at load naming the card, the recall the model reaches and its target (``review_warning``;
``Runner.warning``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from serving.card import (
    REVIEW_REASON,
    CardError,
    ModelCard,
    card_path_for,
    check_card_against_graph,
    read_regular_file,
)
from serving.preprocess import (
    DEFAULT_MAX_PIXELS,
    ImageDecodeError,
    ImageTooLarge,
    decode_image,
    load_image,
    resize_image,
)
from serving.registry import resolve
from serving.tiles import TileView, fuse, max_tiles, tile_chunks, tile_count

log = logging.getLogger(__name__)

PROVIDER_NAMES = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}


def provider_options(
    providers: list[str], trt_cache: str | None = None, trt_fp16: bool = False, cache_prefix: str = ""
) -> list:
    """onnxruntime's ``providers`` argument: names, with options for TensorRT.

    TensorRT builds an engine for the model on first use (tens of seconds to minutes); with a cache
    folder the engine and the timing cache are written there and a restart loads them in seconds.
    ``trt_fp16`` lets TensorRT run layers in fp16 (use it with the fp32 model; the fp16 model already is).
    ``cache_prefix`` names the engines (the runner passes the start of the model's sha256): TensorRT's own
    cache key is the graph's structure, not its weights, so a retrained model of the same architecture
    would otherwise run a stale engine built from the old weights.
    """
    out: list = []
    for name in providers:
        if name == PROVIDER_NAMES["tensorrt"]:
            opts: dict[str, str] = {"trt_fp16_enable": "1" if trt_fp16 else "0"}
            if trt_cache:
                Path(trt_cache).mkdir(parents=True, exist_ok=True)
                opts |= {
                    "trt_engine_cache_enable": "1",
                    "trt_engine_cache_path": str(trt_cache),
                    "trt_timing_cache_enable": "1",
                    "trt_timing_cache_path": str(trt_cache),
                }
                if cache_prefix:
                    opts["trt_engine_cache_prefix"] = cache_prefix
            out.append((name, opts))
        else:
            out.append(name)
    return out


class RunnerError(RuntimeError):
    """The runner refuses to start; the message says why and what to do."""


# onnxruntime's own exception classes (plain Exception subclasses) for a graph it cannot load
ORT_LOAD_ERRORS = (
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidProtobuf,
    ort_state.InvalidGraph,
    ort_state.NoSuchFile,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
)


# Tiles per run of the tile graph: a batch of large photographs holds hundreds, and one run over all of
# them would hold every activation at once. Tiles are also cut run by run (``serving.tiles.tile_chunks``):
# a long thin photograph's tiles, each padded to a full square, are never all in memory.
TILE_CHUNK = 64

# One step of ``Runner.predict_steps``: yields after each model run, returns what ``predict`` returns.
Steps = Generator[None, None, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Budget:
    """What one request (or one file) may cost, checked on declared sizes before decoding or allocating.

    Derived from a pixel limit and the card (``Runner.budget``): ``pixels`` bounds the decoded images (and
    so memory), ``tiles`` the tile graph's work (and so time): a 40 MP limit at 128 px tiles allows the
    2,500 tiles of a 6,324 px square, where a 40,000,000 x 1 strip within the pixel limit would cut 312,500.
    """

    pixels: int  # declared width x height, over all the request's images
    tiles: int  # tiles those images cut into (0: the model has no tile graph)
    tile: int  # tile side in pixels (0: no tile graph)

    def check(self, n: int, height: int, width: int, what: str = "image") -> None:
        """Raise ImageTooLarge naming the limit and the value when ``n`` images of this size exceed it."""
        pixels = n * height * width
        if pixels > self.pixels:
            raise ImageTooLarge(
                f"{what} of {n} x {width}x{height} = {pixels} pixels exceeds the limit of {self.pixels} pixels"
            )
        tiles = self.cost(n, height, width) if self.tile else 0
        if tiles > self.tiles:
            raise ImageTooLarge(
                f"{what} of {n} x {width}x{height} pixels cuts into {tiles} tiles of {self.tile} px, over the "
                f"limit of {self.tiles} tiles (the tiles of the largest square within {self.pixels} pixels)"
            )

    def check_image(self, width: int, height: int) -> None:
        """``check`` for one image, as ``decode_image``'s ``check_size`` takes it."""
        self.check(1, height, width)

    def cost(self, n: int, height: int, width: int) -> int:
        """The work of ``n`` images in model-input units: tiles with a tile graph, else images."""
        return n * tile_count(height, width, self.tile) if self.tile else n


def read_verified(path: Path, expected: str, whose: str) -> bytes:
    """The graph's bytes, read once, refused unless their sha256 is the card's (the file was changed, or the
    card belongs to another model). The session is made from these same bytes, never from the path again,
    so a file swapped after the check is never the one that runs."""
    try:
        data = read_regular_file(path)
    except OSError as exc:
        raise RunnerError(f"{path}: cannot read the model: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise RunnerError(
            f"{path}: sha256 {digest[:12]}... does not match {whose} {expected[:12] or '(none)'}...: "
            "the file was changed or the card belongs to another model"
        )
    return data


def check_graph(session: ort.InferenceSession, card: ModelCard, path: Path, side_field: str) -> None:
    """Refuse a card that does not describe the graph: one uint8 input (N, side, side, channels), with side
    the card's ``side_field`` (input.size or tiles.size), outputs ``probs`` (N, len(classes)) and
    ``defect_score``. An input axis the graph leaves symbolic is not checked; a symbolic output width is,
    by one run on a blank image."""
    side = card.input.size if side_field == "input.size" else card.tiles.size
    spec, k = card.input, len(card.classes)
    inputs, outputs = session.get_inputs(), {o.name: o for o in session.get_outputs()}
    problems = []
    if len(inputs) != 1 or inputs[0].type != "tensor(uint8)" or len(inputs[0].shape) != 4:
        problems.append(f"expected one uint8 input (N, H, W, C), the graph has {[(i.type, i.shape) for i in inputs]}")
    else:
        got = inputs[0].shape[1:]
        if any(isinstance(g, int) and g != w for g, w in zip(got, (side, side, spec.channels), strict=True)):
            problems.append(
                f"card fields '{side_field}' and 'input.channels' give an input (N, {side}, {side}, "
                f"{spec.channels}), the graph takes (N, {', '.join(map(str, got))})"
            )
    if "probs" not in outputs or "defect_score" not in outputs:
        problems.append(f"expected outputs probs and defect_score, the graph has {sorted(outputs)}")
    elif not problems:
        width = outputs["probs"].shape[-1] if len(outputs["probs"].shape) == 2 else None
        if not isinstance(width, int):
            blank = np.zeros((1, side, side, spec.channels), np.uint8)
            width = session.run(["probs"], {inputs[0].name: blank})[0].shape[-1]
        if width != k:
            problems.append(f"card field 'classes' names {k} classes, the graph's probs has {width} columns")
    if problems:
        raise CardError(f"{path}: the model card does not describe this graph: " + "; ".join(problems))


def _machine_has_nvidia_gpu() -> bool:
    # onnxruntime-gpu lists CUDA and TensorRT as "available" even on a machine without a GPU, so
    # "auto" looks for the device itself before asking for a GPU provider.
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()


def resolve_providers(requested: str | list[str]) -> list[str]:
    """Turn ``auto`` or ``cuda,cpu`` into onnxruntime provider names, in order of preference."""
    names = [requested] if isinstance(requested, str) else list(requested)
    names = [n.strip().lower() for part in names for n in part.split(",") if n.strip()]
    available = ort.get_available_providers()
    if names == ["auto"]:
        wanted = ["tensorrt", "cuda", "cpu"] if _machine_has_nvidia_gpu() else ["cpu"]
        return [PROVIDER_NAMES[n] for n in wanted if PROVIDER_NAMES[n] in available]
    unknown = [n for n in names if n not in PROVIDER_NAMES]
    if unknown:
        raise RunnerError(f"unknown provider {unknown[0]!r}: use auto or a list of {', '.join(PROVIDER_NAMES)}")
    missing = [n for n in names if PROVIDER_NAMES[n] not in available]
    if missing:
        raise RunnerError(
            f"provider {missing[0]!r} is not in this onnxruntime build (available: {', '.join(available)})"
        )
    return [PROVIDER_NAMES[n] for n in names]


@dataclass
class Prediction:
    """One file's result (see the module docstring); an unread file has only ``path``, ``latency_ms``, ``error``."""

    path: str
    label: str | None = None  # the most likely class, None when the image could not be read
    probs: dict[str, float] | None = None
    defect_score: float | None = None  # 1 - p(ok), in [0, 1]; sorting: the most likely class's probability
    threshold: float | None = None  # the model card's; defect_score >= threshold -> "defect"; sorting: None
    decision: str | None = None  # "defect" or "ok"; sorting: the most likely class
    reason: str = ""  # the comparison that decided, and why the class disagrees when it does
    model: str = ""  # the card's registered model name
    model_version: str = ""  # registry version, or the start of the model's sha256
    latency_ms: float = 0.0
    error: str = ""


def _pair(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 3 decimals, or as many more as it takes to tell them apart (up to 12)."""
    for digits in range(3, 13):
        sa, sb = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if sa != sb or a == b:
            break
    return sa, sb


def verdict(score: float, threshold: float, label: str, ok_class: str) -> tuple[str, str]:
    """(decision, reason) of one image: "defect" when ``score >= threshold`` (the card's rule), and the
    comparison in words, naming the most likely class ``label`` when it disagrees with the decision."""
    s, t = _pair(score, threshold)
    decision = "defect" if score >= threshold else "ok"
    reason = f"defect score {s} {'>=' if decision == 'defect' else '<'} the card's threshold {t} -> {decision}"
    if (decision == "ok") != (label == ok_class):
        reason += f", although the most likely class is {label}"
    return decision, reason


def sorting_verdict(label: str, p: float) -> tuple[str, str]:
    """(decision, reason) of one image under a defect-type sorting card: the most likely class ``label``,
    whose probability is ``p``; there is no threshold to compare with."""
    return label, f"most likely class {label} at p={p:.3f} (defect-type sorting: no OK class, no threshold)"


def _figure(value: object) -> str:
    """An operating-point figure for a log line: numbers with 3 decimals, anything else as written."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return f"{value:.3f}" if is_number else str(value)


def only_marked_for_review(card: ModelCard) -> bool:
    """Whether the card is not deployable for one reason alone: its operating point is below target (export's
    gate, ``REVIEW_REASON``). Such a model loads with a warning; any other reason needs force."""
    reasons = [r for r in card.not_deployable_reason.split("; ") if r]
    return below_target(card) and bool(reasons) and all(r.startswith(REVIEW_REASON) for r in reasons)


def below_target(card: ModelCard) -> bool:
    """Whether the card's operating point says the model misses its recall target under the false-alarm
    ceiling (the evaluate stage's ``status``): a model marked for review, which still runs."""
    return card.operating_point.get("status") == "below target"


def review_warning(card: ModelCard, where: str) -> str:
    """Why a person should review this model before trusting its decisions ('' when nothing says so): its
    operating point is below target, or the card marks it not deployable. Names ``where`` (the card file), the
    val recall the model reaches and the target, and the operating point's own warnings."""
    op = card.operating_point
    what = ["its operating point is below target"] if below_target(card) else []
    if not card.deployable:
        what.append(f"its card marks it not deployable ({card.not_deployable_reason})")
    if not what:
        return ""
    figures = ""
    if op:
        figures = (
            f": val defect recall {_figure(op.get('val_defect_recall', 'unknown'))} against the target "
            f"{_figure(op.get('target_defect_recall', 'unknown'))}, val false alarm rate "
            f"{_figure(op.get('val_false_alarm_rate', 'unknown'))} against the ceiling "
            f"{_figure(op.get('max_false_alarm_rate', 'unknown'))}"
        )
    warnings = op.get("warnings")
    notes = "".join(f"; {w}" for w in warnings if isinstance(w, str)) if isinstance(warnings, list) else ""
    return (
        f"MODEL MARKED FOR REVIEW: {where}: {' and '.join(what)}{figures}{notes}. It runs as asked: review its "
        "decisions before trusting them on a line"
    )


def session_options(threads: int = 0, spin: bool = True) -> ort.SessionOptions:
    """Full graph optimization; ``threads`` intra-op threads (0: all cores); errors-only logging."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spin:
        # Idle intra-op threads busy-wait for the next run by default (lower latency on a dedicated
        # box); turn it off when other work shares the cores, e.g. side-by-side benchmarks.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: provider fallbacks are reported by us, below
    return options


def open_checked_session(
    model: Path | bytes,
    options: ort.SessionOptions,
    wanted: list[str],
    trt_cache: str | None = None,
    trt_fp16: bool = False,
    allow_cpu_fallback: bool = False,
    cache_prefix: str = "",
) -> ort.InferenceSession:
    """A session on the ``wanted`` providers; fails when a GPU was asked for and only the CPU started.

    ``model`` is the graph's bytes (what the runner passes: the bytes it hashed) or a path.
    onnxruntime falls back to the CPU silently (mismatched CUDA libraries, no GPU); a box meant to run
    on the GPU would then run on the CPU without a word, so that is an error unless ``allow_cpu_fallback``.
    """
    source = model if isinstance(model, bytes) else str(model)
    providers = provider_options(wanted, trt_cache, trt_fp16, cache_prefix)
    try:
        session = ort.InferenceSession(source, options, providers=providers)
    except ORT_LOAD_ERRORS as exc:  # a graph onnxruntime cannot parse or place: a clear refusal, not a traceback
        raise RunnerError(f"onnxruntime cannot load the model: {type(exc).__name__}: {exc}") from None
    got = session.get_providers()
    asked_gpu = any(p != "CPUExecutionProvider" for p in wanted)
    got_gpu = any(p != "CPUExecutionProvider" for p in got)
    if asked_gpu and not got_gpu and not allow_cpu_fallback:
        raise RunnerError(
            f"asked for {wanted} but the session fell back to {got}: the GPU provider could not "
            "start (usually mismatched CUDA/cuDNN libraries or no GPU). Fix the libraries, or pass "
            "--allow-cpu-fallback to run on the CPU."
        )
    return session


class Runner:
    """One loaded model. ``predict`` takes (N, H, W, C) uint8 batches; ``predict_files`` takes paths."""

    def __init__(
        self,
        model_path: str | Path,
        card_path: str | Path | None = None,
        providers: str | list[str] = "auto",
        allow_cpu_fallback: bool = False,
        force: bool = False,
        threads: int = 0,
        warmup: int = 2,
        spin: bool = True,
        trt_cache: str | None = None,
        trt_fp16: bool = False,
        warmup_batch_sizes: tuple[int, ...] = (1,),
        version: str = "",
    ) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise RunnerError(f"{self.model_path}: model file not found")

        def open_session(path: Path, sha256: str, whose: str, side_field: str) -> ort.InferenceSession:
            data = read_verified(path, sha256, whose)
            prefix = f"m{sha256[:16]}"  # TensorRT engines named by the bytes they were built from
            session = open_checked_session(data, options, wanted, trt_cache, trt_fp16, allow_cpu_fallback, prefix)
            check_graph(session, self.card, path, side_field)
            return session

        card_file = Path(card_path or card_path_for(self.model_path))
        self.card = ModelCard.read(card_file)
        wanted = resolve_providers(providers)
        options = session_options(threads, spin)
        spec, tiles = self.card.input, self.card.tiles
        self.session = open_session(self.model_path, self.card.sha256, "the model card's", "input.size")
        metadata = self.session.get_modelmeta().custom_metadata_map
        warning = check_card_against_graph(self.card, metadata, str(card_file), str(self.model_path))
        if warning:
            log.warning("%s", warning)
        if not self.card.deployable and not force and not only_marked_for_review(self.card):
            raise RunnerError(
                f"{self.model_path}: the model card marks variant {self.card.variant!r} not deployable "
                f"({self.card.not_deployable_reason}); pass force to load it anyway"
            )
        self.warning = review_warning(self.card, str(card_file))  # '' when nothing asks for review
        if self.warning:
            log.warning("%s", self.warning)
        self.providers = self.session.get_providers()
        log.info("model %s (%s), providers in use: %s", self.card.name, self.card.variant, self.providers)
        self.input_name = self.session.get_inputs()[0].name
        self.input_shape = (spec.size, spec.size, spec.channels)
        self.tile_session = None
        warm_shape = self.input_shape
        if tiles is not None:
            # Photographs of any size: the whole graph gets each one resized, the tile graph its 1:1 tiles.
            # The card's tiles.model is a bare file name (the schema refuses a path), so this stays beside it.
            tile_path = self.model_path.parent / tiles.model
            if not tile_path.is_file():
                raise RunnerError(
                    f"{tile_path}: tile graph not found (the card's tiles.model; export writes it beside "
                    f"{self.model_path.name}, and a registry version holds both)"
                )
            self.tile_session = open_session(tile_path, tiles.sha256, "the model card's tiles", "tiles.size")
            self.tile_input = self.tile_session.get_inputs()[0].name
            self.input_shape = (-1, -1, spec.channels)
            warm_shape = (tiles.size, tiles.size, spec.channels)  # one tile per image: both graphs at batch n
        # The first runs allocate, tune and (TensorRT) build engines: pay for them before "ready", at each
        # batch size the caller expects (the server's maximum batch, say), and for the tile graph at a full chunk.
        for n in warmup_batch_sizes:
            for _ in range(warmup):
                self.predict(np.zeros((n, *warm_shape), dtype=np.uint8))
        if self.tile_session is not None and warmup:
            self._tile_probs(np.zeros((TILE_CHUNK, *warm_shape), dtype=np.uint8))
        # The registry version, or the start of the model's sha256 for a plain file.
        self.version = version or self.card.sha256[:12]
        self.ready = True

    def _check(self, batch: np.ndarray) -> None:
        ok = batch.dtype == np.uint8 and batch.ndim == 4 and min(batch.shape[1:3]) >= 1
        if not ok or any(want not in (-1, got) for want, got in zip(self.input_shape, batch.shape[1:], strict=True)):
            want = ", ".join("any" if d == -1 else str(d) for d in self.input_shape)
            raise ValueError(f"expected uint8 (N, {want}), got {batch.dtype} {tuple(batch.shape)}")

    def budget(self, max_pixels: int = DEFAULT_MAX_PIXELS) -> Budget:
        """The per-request budget for this card under a pixel limit (``Budget``)."""
        tiles = self.card.tiles
        if tiles is None:
            return Budget(max_pixels, 0, 0)
        return Budget(max_pixels, max_tiles(max_pixels, tiles.size), tiles.size)

    def _tile_probs(self, tiles: np.ndarray) -> np.ndarray:
        """(T, size, size, C) tiles -> (T, K) probabilities, in runs of at most TILE_CHUNK tiles."""
        runs = [
            self.tile_session.run(["probs"], {self.tile_input: tiles[i : i + TILE_CHUNK]})[0]
            for i in range(0, len(tiles), TILE_CHUNK)
        ]
        return np.concatenate(runs)

    def _views_steps(self, batch: np.ndarray) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """``predict_views`` one model run at a time: the whole graph, then each run of tiles, cut as needed
        (at most TILE_CHUNK tiles in memory, whatever the photographs' sizes)."""
        if self.tile_session is None:
            raise ValueError(f"{self.model_path}: the model card has no tile graph")
        self._check(batch)
        spec, size = self.card.input, self.card.tiles.size
        resized = np.stack([resize_image(img, spec.size, spec.resize) for img in batch])
        whole = self.session.run(["probs"], {self.input_name: resized})[0]
        view = TileView(len(batch), whole.shape[1], self.card.ok_index)
        for parent, tiles in tile_chunks(batch, size, TILE_CHUNK):
            yield
            view.add(parent, self.tile_session.run(["probs"], {self.tile_input: tiles})[0])
        return whole, view.probs()

    def predict_views(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(N, H, W, C) uint8 photographs -> the two views ``predict`` fuses, each (N, K): the whole-image
        graph's probabilities (each photograph resized to the input) and each photograph's most suspicious
        tile's (``serving.tiles``). For a model with tiles only; diagnostics see which view decided."""
        return run_steps(self._views_steps(batch))

    def predict_steps(self, batch: np.ndarray) -> Steps:
        """``predict`` as a generator that yields after each model run (one for a model without tiles; the
        whole graph, then each run of at most TILE_CHUNK tiles) and returns what ``predict`` returns, so a
        scheduler can run other requests between the runs of a large one (``serving.batcher``)."""
        if self.tile_session is None:
            self._check(batch)
            probs, score = self.session.run(["probs", "defect_score"], {self.input_name: batch})
            return probs, score
        whole, tiles = yield from self._views_steps(batch)
        probs = fuse(whole, tiles, self.card.tiles.weight)
        return probs, (1 - probs[:, self.card.ok_index]).astype(np.float32)

    def predict(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(N, H, W, C) uint8 -> probabilities (N, K) float32 and defect scores (N,) float32.

        Without tiles the batch is the model input, (N, size, size, C); with tiles it is N photographs of
        any one size at full resolution, and the result is the two views fused by the card's weight."""
        return run_steps(self.predict_steps(batch))

    def load(self, source: str | Path | bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
        """One file (or its bytes) as ``predict`` takes it: the model input, or with tiles the photograph
        at full resolution (no draft decode: the tiles see it at 1:1). Refused before decoding (an
        ImageTooLarge) when its declared size is over ``budget(max_pixels)``: a strip within the pixel
        limit can still cut into far more tiles than a photograph."""
        spec = self.card.input
        if self.tile_session is not None:
            return decode_image(source, spec.channels, max_pixels, check_size=self.budget(max_pixels).check_image)
        return load_image(source, spec.size, spec.channels, spec.resize, max_pixels)

    def decide(self, probs: np.ndarray, score: float) -> tuple[str, str, str]:
        """(class, decision, reason) of one image's (K,) probabilities and defect score (``verdict``, or for a
        sorting card ``sorting_verdict``)."""
        top = int(np.argmax(probs))
        label = self.card.classes[top]
        if self.card.sorting:
            return label, *sorting_verdict(label, float(probs[top]))
        return label, *verdict(score, self.card.threshold, label, self.card.ok_class)

    def predict_files(self, paths: Iterable[str | Path], batch_size: int = 16) -> Iterator[Prediction]:
        """Score files in batches; a file that cannot be read yields an error row, never an exception.

        A batch holds images of one shape: with tiles, a photograph of another size than the ones waiting
        sends those first (a line's camera gives one size, so batches stay full)."""
        pending: list[tuple[str, np.ndarray, float]] = []

        def flush() -> Iterator[Prediction]:
            t0 = time.perf_counter()
            probs, scores = self.predict(np.stack([img for _, img, _ in pending]))
            infer_ms = (time.perf_counter() - t0) * 1000 / len(pending)
            for (path, _, decode_ms), p, s in zip(pending, probs, scores, strict=True):
                label, decision, reason = self.decide(p, float(s))
                yield Prediction(
                    path,
                    label,
                    dict(zip(self.card.classes, map(float, p), strict=True)),
                    float(s),
                    self.card.threshold,
                    decision,
                    reason,
                    self.card.name,
                    self.version,
                    decode_ms + infer_ms,
                )
            pending.clear()

        for path in paths:
            t0 = time.perf_counter()
            try:
                img = self.load(path)
            except (ImageDecodeError, OSError) as exc:
                yield Prediction(str(path), latency_ms=(time.perf_counter() - t0) * 1000, error=str(exc))
                continue
            if pending and img.shape != pending[0][1].shape:
                yield from flush()
            pending.append((str(path), img, (time.perf_counter() - t0) * 1000))
            if len(pending) >= batch_size:
                yield from flush()
        if pending:
            yield from flush()


def run_steps(steps: Generator[None, None, tuple]) -> tuple:
    """Run a step generator (``Runner.predict_steps``) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def open_runner(source: str, card: str | None = None, tracking_uri: str | None = None, **options) -> Runner:
    """A Runner for a model file or a ``models:/NAME@ALIAS`` registry URI (see serving.registry)."""
    src = resolve(source, card, tracking_uri)
    return Runner(src.model_path, src.card_path, version=src.version, **options)


__all__ = [
    "Budget",
    "CardError",
    "Prediction",
    "Runner",
    "RunnerError",
    "open_runner",
    "resolve_providers",
    "review_warning",
    "sorting_verdict",
    "verdict",
]
