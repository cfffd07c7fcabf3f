"""Hand audio from an engine thread to the asyncio consumer without polling.

The engine thread calls `put()` / `finish()` / `fail()`; the event loop iterates. Wake-ups go
through `loop.call_soon_threadsafe`, so the consumer sleeps until there is work.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from engine.api import AudioChunk, EngineError

_END = object()


class ChunkChannel:
    """One request's chunks, engine thread -> event loop. Unbounded on purpose: the engine never
    waits on a client; the gateway's per-session queue applies the backpressure."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    # -- producer side (any thread) --------------------------------------------------------
    def put(self, chunk: AudioChunk) -> None:
        self._loop.call_soon_threadsafe(self._push, chunk)

    def finish(self) -> None:
        self._loop.call_soon_threadsafe(self._push, _END)

    def fail(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._push, error)

    # -- consumer side (event loop) --------------------------------------------------------
    def _push(self, item: object) -> None:
        if self._closed:
            return
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Consumer gives up: drop what is queued and end iteration."""
        self._closed = True
        self._items.clear()
        self._items.append(_END)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def pending(self) -> int:
        return len(self._items)

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        while True:
            while not self._items:
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            item = self._items.popleft()
            if item is _END:
                return
            if isinstance(item, BaseException):
                if isinstance(item, EngineError):
                    raise item
                raise EngineError(str(item)) from item
            assert isinstance(item, AudioChunk)
            yield item
            if item.final:
                return
