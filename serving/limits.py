"""What the HTTP server's requests may hold at once: a memory pool for their heavy phases, body slots.

Per request, ``serving.runner.Budget`` bounds what one request may ask for (pixels, tiles), checked on
declared sizes before anything is decoded or allocated. This module bounds what all requests together
hold: decoding an image, parsing a JSON body or inflating a gzip body first reserves its estimated peak
in a ``MemoryPool`` and holds it until the response is computed. A reservation larger than ``small``
bytes may use only ``capacity - reserve`` of the pool, so large requests cannot take the memory that
keeps ordinary ones flowing; one that could never fit is refused (413), one that waits past its request's
deadline is answered 503 with Retry-After (``serving.batcher.Overloaded``). Bodies over ``SMALL_BODY``
are received only in one of ``LARGE_BODIES`` slots; smaller ones are bounded by the connection limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from serving.batcher import Overloaded

MB = 1 << 20
SMALL_BODY = MB  # bodies up to this size are received without a slot (a photograph is ~0.1-1 MB)
LARGE_BODIES = 4  # bodies over SMALL_BODY received at once: 4 x --max-body-mb at most
SMALL_HOLD = 16 * MB  # a reservation up to this (a 1 MP decode) may use the pool's reserve
SMALL_RESERVE = 64 * MB  # pool memory that only reservations up to SMALL_HOLD may use

# Peak memory of json.loads + np.asarray on a body, measured: 4-12 bytes per body byte for numbers,
# plus about 144 per list or object (``[0],`` parsed as a one-element list costs 36 bytes per body byte).
JSON_BYTES_PER_BYTE = 12
JSON_BYTES_PER_CONTAINER = 144


# json.loads and np.asarray hold the GIL: while they parse, no other request moves (measured here: 4 MB of
# flat numbers 0.05-0.15 s; 4 MB of [0,0,0] lists 0.5 s, 8 MB of [0] lists 1.3 s). So the JSON part of a
# request is capped at what the model's largest tensor takes as JSON text, 5 bytes a value ("255, "), at
# least MIN_JSON_BYTES, and may hold no more lists and objects than that tensor nested row by row has;
# larger tensors (photographs for a model with tiles) go as binary tensor data, or as images to /classify.
JSON_BYTES_PER_VALUE = 5
MIN_JSON_BYTES = 256 * 1024


def max_json_bytes(max_values: int) -> int:
    """The cap on a request's JSON part when the model's largest input holds ``max_values`` numbers."""
    return max(MIN_JSON_BYTES, JSON_BYTES_PER_VALUE * max_values + 64 * 1024)


def json_containers(text: bytes) -> int:
    """Lists and objects in a JSON text (brackets inside strings counted too: an upper bound)."""
    return text.count(b"[") + text.count(b"{")


def json_parse_bytes(text: bytes) -> int:
    """Estimated peak memory of parsing ``text`` as JSON into lists and then one numpy array."""
    return JSON_BYTES_PER_BYTE * len(text) + JSON_BYTES_PER_CONTAINER * json_containers(text)


class MemoryPool:
    """Bytes that requests' heavy phases may hold at once (see the module docstring)."""

    def __init__(self, capacity: int, small: int = SMALL_HOLD, reserve: int = SMALL_RESERVE) -> None:
        self.capacity, self.small, self.reserve = capacity, small, min(reserve, capacity // 2)
        self.used = 0
        self.changed = asyncio.Condition()

    def limit_for(self, n: int) -> int:
        """The most of the pool a reservation of ``n`` bytes may fill."""
        return self.capacity if n <= self.small else self.capacity - self.reserve

    def fits_ever(self, n: int) -> bool:
        return n <= self.limit_for(n)

    @contextlib.asynccontextmanager
    async def hold(self, n: int, deadline: float, what: str) -> AsyncIterator[None]:
        """Hold ``n`` bytes for the ``with`` block; wait for them until ``deadline`` (time.perf_counter()).

        The caller checks ``fits_ever`` first (a request that can never fit is the client's 413)."""
        limit = self.limit_for(n)
        async with self.changed:
            if self.used + n > limit:
                left = deadline - time.perf_counter()
                try:
                    await asyncio.wait_for(self.changed.wait_for(lambda: self.used + n <= limit), max(left, 0))
                except TimeoutError:
                    raise Overloaded(
                        f"{what} needs {n / MB:.0f} MB of request memory and the server's "
                        f"{self.capacity / MB:.0f} MB were in use until the request's deadline",
                        1.0,
                    ) from None
            self.used += n
        try:
            yield
        finally:
            async with self.changed:
                self.used -= n
                self.changed.notify_all()


class Slots:
    """At most ``n`` holders at once; a waiter past its deadline is answered Overloaded."""

    def __init__(self, n: int) -> None:
        self.free = asyncio.Semaphore(n)

    @contextlib.asynccontextmanager
    async def hold(self, deadline: float, what: str) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self.free.acquire(), max(deadline - time.perf_counter(), 0))
        except TimeoutError:
            raise Overloaded(f"no slot for {what} before the request's deadline", 1.0) from None
        try:
            yield
        finally:
            self.free.release()
