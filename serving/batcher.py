"""Dynamic batching: concurrent requests share one model call.

Requests (each a (n, H, W, C) uint8 array) wait in a queue. The batcher takes the oldest, then keeps
adding requests of the same shape until the batch holds ``max_batch_size`` images or the oldest has
waited ``max_queue_delay`` seconds, and runs the model once in a single inference thread. While that
call runs, the next batch forms, so under load batches fill up by themselves. A request is never
split across batches.

The delay is only spent when it can buy something: handlers announce a request when it arrives
(``slot()``), before parsing or decoding it, and the batcher waits only while announced requests are
still on their way. A lone client pays no delay at all (measured on 2 cores with the int8 model: 119
instead of 65 img/s at concurrency 1), while under load the requests being decoded join the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# The model call: a (N, H, W, C) batch -> (outputs by name, each with N rows; an opaque tag such as the
# model version that produced them).
InferFn = Callable[[np.ndarray], tuple[dict[str, np.ndarray], Any]]


@dataclass
class BatchResult:
    outputs: dict[str, np.ndarray]  # this request's rows only
    tag: Any  # what InferFn returned beside the outputs (e.g. the model version)
    queue_s: float  # waiting before the model call started
    infer_s: float  # the model call (shared by the whole batch)
    batch_size: int  # images in the batch this request rode in


@dataclass
class _Item:
    x: np.ndarray
    future: asyncio.Future
    enqueued: float


class Batcher:
    def __init__(
        self,
        infer: InferFn,
        max_batch_size: int = 16,
        max_queue_delay: float = 0.005,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.infer, self.max_batch_size, self.max_queue_delay = infer, max_batch_size, max_queue_delay
        self.on_batch = on_batch  # (batch size, inference seconds) -> None, for metrics
        self.queue: deque[_Item] = deque()
        self.arrived = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer")
        self.task: asyncio.Task | None = None
        self.in_flight = 0  # requests submitted and not yet answered
        self.arriving = 0  # requests announced by a handler and not queued yet (parsing, decoding)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        """Finish every queued request, then stop (graceful shutdown calls this last)."""
        while self.queue:
            await asyncio.sleep(0.01)
        if self.task:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.executor.shutdown(wait=True)

    @contextlib.asynccontextmanager
    async def slot(self):
        """``async with batcher.slot() as submit: ... await submit(x)``: announce a request early."""
        self.arriving += 1
        queued = False

        async def submit(x: np.ndarray) -> BatchResult:
            nonlocal queued
            queued = True
            self.arriving -= 1
            return await self.submit(x)

        try:
            yield submit
        finally:
            if not queued:  # the request failed before reaching the queue
                self.arriving -= 1
                self.arrived.set()

    async def submit(self, x: np.ndarray) -> BatchResult:
        future = asyncio.get_running_loop().create_future()
        self.queue.append(_Item(x, future, time.perf_counter()))
        self.arrived.set()
        self.in_flight += 1
        try:
            return await future
        finally:
            self.in_flight -= 1

    def _take_batch(self) -> list[_Item]:
        first = self.queue.popleft()
        items, rows = [first], len(first.x)
        while self.queue and self.queue[0].x.shape[1:] == first.x.shape[1:]:
            if rows + len(self.queue[0].x) > self.max_batch_size:
                break
            item = self.queue.popleft()
            items.append(item)
            rows += len(item.x)
        return items

    async def _run(self) -> None:
        while True:
            while not self.queue:  # woken also when an announced request fails before it is queued
                self.arrived.clear()
                await self.arrived.wait()
            # Give requests on their way up to max_queue_delay (from the oldest one's arrival) to join.
            deadline = self.queue[0].enqueued + self.max_queue_delay
            while self.arriving > 0 and sum(len(i.x) for i in self.queue) < self.max_batch_size:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), left)
                except TimeoutError:
                    break
            items = [i for i in self._take_batch() if not i.future.done()]  # skip clients that went away
            if items:
                try:
                    await self._execute(items)
                except Exception as exc:  # whatever fails, those requests hear why and the loop goes on
                    log.exception("batch of %d requests failed", len(items))
                    for i in items:
                        if not i.future.done():
                            i.future.set_exception(exc)

    async def _execute(self, items: list[_Item]) -> None:
        batch = items[0].x if len(items) == 1 else np.concatenate([i.x for i in items])
        started = time.perf_counter()
        outputs, tag = await asyncio.get_running_loop().run_in_executor(self.executor, self.infer, batch)
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
