"""One utterance's engine audio, handed to its session as it comes (engine.api.listen): no task,
no future and no coroutine switch per chunk, which iterating the stream would take.

The engine never waits for a client. While the session's audio lane is full, or while the
utterance is throttled (paused with its buffer full), chunks wait here in the order they came,
and a task feeds them on as the lane makes room."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from engine.api import AudioChunk

_END = object()  # in the held items: the stream ended
_Item = AudioChunk | BaseException | object


class StreamListener:
    """engine.api.ChunkListener for one utterance. `take` gets each chunk; then exactly one of
    `ended` or `failed` is called, unless `close()` came first. `room` is set while the session's
    audio lane takes more. An exception while taking a chunk fails this utterance alone."""

    __slots__ = ("_take", "_ended", "_failed", "_room", "_held", "_feeder", "_unthrottled", "closed")

    def __init__(
        self,
        take: Callable[[AudioChunk], None],
        ended: Callable[[], None],
        failed: Callable[[BaseException], None],
        room: asyncio.Event,
    ) -> None:
        self._take = take
        self._ended = ended
        self._failed = failed
        self._room = room
        self._held: deque[_Item] | None = None  # items waiting for room, in order
        self._feeder: asyncio.Task[None] | None = None
        self._unthrottled: asyncio.Event | None = None  # None: not throttled
        self.closed = False

    # -- engine.api.ChunkListener --------------------------------------------------------------
    def chunk(self, chunk: AudioChunk) -> None:
        if self._held is None and not self.closed and self._unthrottled is None and self._room.is_set():
            try:
                self._take(chunk)
            except Exception as exc:
                self._take_failed(exc)
            return
        self._on(chunk)

    def end(self) -> None:
        self._on(_END)

    def fail(self, error: BaseException) -> None:
        self._on(error)

    # -- the session's side --------------------------------------------------------------------
    def throttle(self, on: bool) -> None:
        """Hold every item back (`on`) until throttled off; they keep their order."""
        if on:
            if self._unthrottled is None:
                self._unthrottled = asyncio.Event()
            return
        gate, self._unthrottled = self._unthrottled, None
        if gate is not None:
            gate.set()

    def close(self) -> None:
        """Nothing more reaches the session (a cancel, or the session's end)."""
        self.closed = True
        self._held = None
        if self._feeder is not None and self._feeder is not asyncio.current_task():
            self._feeder.cancel()
        self._feeder = None

    def _on(self, item: _Item) -> None:
        if self.closed:
            return
        if self._held is not None or self._unthrottled is not None or not self._room.is_set():
            if self._held is None:
                self._held = deque()
                self._feeder = asyncio.get_running_loop().create_task(self._feed())
            self._held.append(item)
            return
        self._give(item)

    def _give(self, item: _Item) -> None:
        try:
            if isinstance(item, AudioChunk):
                self._take(item)
                return
            self.close()
            if isinstance(item, BaseException):
                self._failed(item)
            else:
                self._ended()
        except Exception as exc:
            self._take_failed(exc)

    def _take_failed(self, exc: Exception) -> None:
        """A chunk the session could not take ends this utterance only."""
        if not self.closed:
            self.close()
            self._failed(exc)

    async def _feed(self) -> None:
        held = self._held
        while held and not self.closed:
            if (gate := self._unthrottled) is not None:
                await gate.wait()
                continue
            if not self._room.is_set():
                await self._room.wait()
                continue
            self._give(held.popleft())
        if self._held is held:
            self._held = None
        self._feeder = None
