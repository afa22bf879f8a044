"""Dynamic batching and fair scheduling: concurrent requests share one model call, large ones take turns.

Requests (each a (n, H, W, C) uint8 array) wait in a queue. The batcher takes the oldest, then keeps
adding requests of the same shape until the batch holds ``max_batch_size`` images (or ``max_batch_cost``
units of work: tiles for a model with a tile graph) or the oldest has waited ``max_queue_delay`` seconds,
and runs the model once in a single inference thread. While that call runs, the next batch forms, so under
load batches fill up by themselves. A request is never split across batches.

The delay is only spent when it can buy something: handlers announce a request when it arrives
(``slot()``), before parsing or decoding it, and the batcher waits only while announced requests are
still on their way. A lone client pays no delay at all (measured on 2 cores with the int8 model: 119
instead of 65 img/s at concurrency 1), while under load the requests being decoded join the batch.

**Two lanes.** A request whose work is more than one batch (``cost(x) > max_batch_cost``: a photograph of
more than 64 tiles, say) is never batched: it goes to the large lane, where the model call is a generator
of steps (``Runner.predict_steps``: the whole graph, then one run of at most 64 tiles per step). Between
two steps the batcher serves every small batch that is waiting, and the large requests take turns (one
step each, round robin). So a small request waits for at most one step of large work, however many tiles
the large ones have, and a large one is never starved by another. A request still waiting or running past
its deadline is answered with ``Overloaded`` (the server's 503 with Retry-After) and its steps stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# The model call: a (N, H, W, C) batch -> (outputs by name, each with N rows; an opaque tag such as the
# model version that produced them). Either a plain function or a generator function that yields between
# its model runs and returns that pair (``InferSteps``): only the latter's requests can take turns.
Outputs = tuple[dict[str, np.ndarray], Any]
InferFn = Callable[[np.ndarray], Outputs]
InferSteps = Callable[[np.ndarray], Generator[None, None, Outputs]]


class Overloaded(Exception):
    """The request could not be served within its deadline; ``retry_after`` (s) estimates when it could."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


@dataclass
class BatchResult:
    outputs: dict[str, np.ndarray]  # this request's rows only
    tag: Any  # what InferFn returned beside the outputs (e.g. the model version)
    queue_s: float  # waiting before the model call started
    infer_s: float  # the model call (shared by the whole batch); a large request: the sum of its steps
    batch_size: int  # images in the batch this request rode in


@dataclass
class _Item:
    x: np.ndarray
    future: asyncio.Future
    enqueued: float
    cost: int  # work units (images, or tiles)
    deadline: float | None  # time.perf_counter() after which it is answered Overloaded
    steps: Generator | None = None  # large lane: the model call in progress
    started: float = 0.0
    infer_s: float = 0.0
    done_steps: int = 0


def _as_steps(infer: InferFn) -> InferSteps:
    """A plain model call as a generator function of one step."""

    def steps(batch: np.ndarray) -> Generator[None, None, Outputs]:
        return infer(batch)
        yield  # never reached: makes this a generator function

    return steps


def _step(steps: Generator) -> tuple[bool, Any]:
    """One step of a model call, in the inference thread: (finished, its outputs when finished)."""
    try:
        next(steps)
    except StopIteration as done:
        return True, done.value
    return False, None


def _run_all(steps: Generator) -> Outputs:
    while True:
        finished, value = _step(steps)
        if finished:
            return value


class Batcher:
    def __init__(
        self,
        infer: InferFn | InferSteps,
        max_batch_size: int = 16,
        max_queue_delay: float = 0.005,
        on_batch: Callable[[int, float], None] | None = None,
        cost: Callable[[np.ndarray], int] = len,
        max_batch_cost: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.infer = infer if inspect.isgeneratorfunction(infer) else _as_steps(infer)
        self.max_batch_size, self.max_queue_delay = max_batch_size, max_queue_delay
        self.cost = cost  # (n, ...) request -> its work units (default: images)
        self.max_batch_cost = max_batch_cost or max_batch_size  # work one batch or one step may hold
        self.on_batch = on_batch  # (batch size, inference seconds) -> None, for metrics
        self.queue: deque[_Item] = deque()  # small requests, batched
        self.large: deque[_Item] = deque()  # large requests, one step each in turn
        self.arrived = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer")
        self.task: asyncio.Task | None = None
        self.in_flight = 0  # requests submitted and not yet answered
        self.arriving = 0  # requests announced by a handler and not queued yet (parsing, decoding)
        self.step_s = 0.05  # running mean of one large step's seconds (for Retry-After)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        """Finish every queued request, then stop (graceful shutdown calls this last)."""
        while self.queue or self.large:
            await asyncio.sleep(0.01)
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.executor.shutdown(wait=True)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Callable[..., Any]]:
        """``async with batcher.slot() as submit: ... await submit(x)``: announce a request early."""
        self.arriving += 1
        queued = False

        async def submit(x: np.ndarray, deadline: float | None = None) -> BatchResult:
            nonlocal queued
            queued = True
            self.arriving -= 1
            return await self.submit(x, deadline)

        try:
            yield submit
        finally:
            if not queued:  # the request failed before reaching the queue
                self.arriving -= 1
                self.arrived.set()

    async def submit(self, x: np.ndarray, deadline: float | None = None) -> BatchResult:
        """Score ``x`` (n, ...); ``deadline`` (a ``time.perf_counter()`` value) bounds its wait and run."""
        future = asyncio.get_running_loop().create_future()
        item = _Item(x, future, time.perf_counter(), int(self.cost(x)), deadline)
        (self.large if item.cost > self.max_batch_cost else self.queue).append(item)
        self.arrived.set()
        self.in_flight += 1
        try:
            return await future
        finally:
            self.in_flight -= 1

    def backlog_s(self) -> float:
        """Seconds of large work queued, estimated from its cost and the mean step (for Retry-After)."""
        steps = sum(math.ceil(i.cost / self.max_batch_cost) + 1 - i.done_steps for i in self.large)
        return steps * self.step_s

    def _expired(self, item: _Item) -> bool:
        """Answer an item whose client went away or whose deadline passed; True when it must not run."""
        if item.future.done():
            return True
        if item.deadline is not None and time.perf_counter() > item.deadline:
            waited = time.perf_counter() - item.enqueued
            what = f"after {item.done_steps} model runs" if item.done_steps else "before its model run started"
            item.future.set_exception(
                Overloaded(f"the request ran out of time {what} ({waited:.1f} s in the queue)", self.backlog_s())
            )
            return True
        return False

    def _take_batch(self) -> list[_Item]:
        first = self.queue.popleft()
        items, rows, cost = [first], len(first.x), first.cost
        while self.queue and self.queue[0].x.shape[1:] == first.x.shape[1:]:
            nxt = self.queue[0]
            if rows + len(nxt.x) > self.max_batch_size or cost + nxt.cost > self.max_batch_cost:
                break
            items.append(self.queue.popleft())
            rows, cost = rows + len(nxt.x), cost + nxt.cost
        return items

    async def _gather(self) -> None:
        """Give requests on their way up to max_queue_delay (from the oldest one's arrival) to join."""
        deadline = self.queue[0].enqueued + self.max_queue_delay
        while self.arriving > 0 and sum(len(i.x) for i in self.queue) < self.max_batch_size:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                return

    async def _run(self) -> None:
        while True:
            while not self.queue and not self.large:  # woken also when an announced request fails early
                self.arrived.clear()
                await self.arrived.wait()
            if self.queue:
                if not self.large:  # the delay is spent only when no large work could run meanwhile
                    await self._gather()
                items = [i for i in self._take_batch() if not self._expired(i)]
                if items:
                    await self._guarded(self._execute(items), items)
            else:
                item = self.large[0]
                if self._expired(item):
                    self.large.popleft()
                    if item.steps is not None:
                        item.steps.close()
                    continue
                await self._guarded(self._large_step(item), [item])

    async def _guarded(self, work, items: list[_Item]) -> None:
        """Run ``work``; whatever fails, those requests hear why and the loop goes on."""
        try:
            await work
        except Exception as exc:  # noqa: BLE001 (one request's failure must not stop the batcher)
            log.exception("batch of %d requests failed", len(items))
            for i in items:
                with contextlib.suppress(ValueError):
                    self.large.remove(i)
                if not i.future.done():
                    i.future.set_exception(exc)

    async def _execute(self, items: list[_Item]) -> None:
        batch = items[0].x if len(items) == 1 else np.concatenate([i.x for i in items])
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        outputs, tag = await loop.run_in_executor(self.executor, _run_all, self.infer(batch))
        infer_s = time.perf_counter() - started
        if self.on_batch:
            self.on_batch(len(batch), infer_s)
        row = 0
        for i in items:
            n = len(i.x)
            mine = {k: v[row : row + n] for k, v in outputs.items()}
            row += n
            if not i.future.done():
                i.future.set_result(BatchResult(mine, tag, started - i.enqueued, infer_s, len(batch)))

    async def _large_step(self, item: _Item) -> None:
        """One step of the large lane's head; then it goes to the back of the lane, or is answered."""
        if item.steps is None:
            item.steps, item.started = self.infer(item.x), time.perf_counter()
        t0 = time.perf_counter()
        finished, value = await asyncio.get_running_loop().run_in_executor(self.executor, _step, item.steps)
        took = time.perf_counter() - t0
        item.infer_s += took
        item.done_steps += 1
        self.step_s = 0.8 * self.step_s + 0.2 * took
        self.large.popleft()
        if not finished:
            self.large.append(item)  # round robin: the next large request takes the next step
            return
        if self.on_batch:
            self.on_batch(len(item.x), item.infer_s)
        if not item.future.done():
            outputs, tag = value
            item.future.set_result(BatchResult(outputs, tag, item.started - item.enqueued, item.infer_s, len(item.x)))
