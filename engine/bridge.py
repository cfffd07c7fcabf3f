"""Hand audio from an engine thread to the asyncio consumer without polling.

The engine thread calls `put()` / `finish()` / `fail()`; the event loop iterates. Wake-ups go
through `loop.call_soon_threadsafe`, so the consumer sleeps until there is work. Items for all the
channels of one loop travel through one mailbox: a step that hands out a hundred chunks wakes the
loop once, not a hundred times (each wake-up is a write to the loop's self-pipe). A stream's first
chunk is delivered ahead of the other streams' later ones: it is what a listener is waiting for.

A consumer that forwards chunks (the engine worker process, the gateway's session) can have a
channel `listen()` instead of iterating it: the channel then calls the listener on the loop as
items arrive, with no task per stream (a stream over a channel offers this as
engine.api.SynthesisStream.listen). Such a consumer can also take the items on the engine thread
itself (`deliver_on_producer_thread`): no loop wake-up, and no second thread contending for the
GIL with the engine's step thread.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from engine.api import AudioChunk, ChunkListener, EngineError

_END = object()


_Item = TypeVar("_Item")
_T = TypeVar("_T")


def _hand_queued(listener: ChunkListener, items: deque[_Item]) -> bool:
    """Hand queued items to a listener in order; True when one ended the stream (the rest dropped)."""
    while items:
        if _hand(listener, items.popleft()):
            items.clear()
            return True
    return False


def _hand(listener: ChunkListener, item: object) -> bool:
    """Give one item to a listener; True when it ends the stream."""
    if isinstance(item, AudioChunk):
        listener.chunk(item)
        if not item.final:
            return False
        listener.end()
    elif isinstance(item, BaseException):
        listener.fail(item)
    else:
        listener.end()
    return True


def deliver_on_producer_thread(loop: asyncio.AbstractEventLoop, after_batch: Callable[[], None]) -> None:
    """From now on, items posted to `loop`'s channels that have a listener reach it on the posting
    thread, as they are posted (a batch's first chunks first), and `after_batch` runs after each
    post; such listeners must be thread-safe. Iterated channels are still fed on the loop. Call it
    on the loop."""
    _Mailbox.of(loop).after_batch = after_batch


class _Mailbox:
    """Items posted to a loop's channels from other threads, delivered in order, in batches."""

    _of_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
    _created = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        box = cls._of_loop.get(loop)
        if box is None:
            with cls._created:
                box = cls._of_loop.setdefault(loop, _Mailbox(loop))
        return box

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[ChunkChannel, object]] = []
        self._wake_pending = False
        self.after_batch: Callable[[], None] | None = None  # set: items go out on the posting thread

    def post(self, channel: ChunkChannel, item: object) -> None:
        self.post_many([(channel, item)])

    def post_many(self, items: list[tuple[ChunkChannel, object]]) -> None:
        after_batch = self.after_batch
        if after_batch is not None:
            self._deliver_to_listeners(items, after_batch)
            return
        with self._lock:
            self._items += items
            if self._wake_pending:
                return
            self._wake_pending = True
        self._wake()

    def _deliver_to_listeners(
        self, items: list[tuple[ChunkChannel, object]], after_batch: Callable[[], None]
    ) -> None:
        """Listened channels' items here and now, the others' through the loop."""
        with self._lock:  # producers one at a time, and never while the loop listens or closes
            if all(channel._listener is not None for channel, _ in items):
                here, wake = items, False
            else:
                here = [pair for pair in items if pair[0]._listener is not None]
                self._items += [pair for pair in items if pair[0]._listener is None]
                wake, self._wake_pending = not self._wake_pending, True
            _push_all(here)
        if wake:
            self._wake()
        after_batch()

    def take(self, channel: ChunkChannel) -> list[object]:
        """The items posted to `channel` and not yet delivered, taken out (call under the lock)."""
        taken = [item for c, item in self._items if c is channel]
        if taken:
            self._items = [pair for pair in self._items if pair[0] is not channel]
        return taken

    def on_loop(self, action: Callable[[], _T]) -> _T:
        """Run a consumer-side action of a channel: under the lock when producers deliver."""
        if self.after_batch is None:
            return action()
        with self._lock:
            return action()

    def _wake(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to read
            with self._lock:
                self._wake_pending = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._wake_pending = False
        _push_all(items)


def _push_all(items: list[tuple[ChunkChannel, object]]) -> None:
    """Hand items to their channels in order, first chunks first (each with what follows it)."""
    fresh = [pair for pair in items if not pair[0]._started]
    if fresh and len(fresh) < len(items):
        items = fresh + [pair for pair in items if pair[0]._started]
    for channel, item in items:
        channel._push(item)


class ChunkBatch:
    """Items for many channels, posted together (a step's outputs): one lock round-trip and at most
    one wake-up per event loop instead of one per item, and the loop takes the whole step at once,
    its first chunks first. Nothing reaches a channel before `post()`."""

    def __init__(self) -> None:
        self._posts: dict[_Mailbox, list[tuple[ChunkChannel, object]]] = {}

    def put(self, channel: ChunkChannel, chunk: AudioChunk) -> None:
        self._add(channel, chunk)

    def finish(self, channel: ChunkChannel) -> None:
        self._add(channel, _END)

    def fail(self, channel: ChunkChannel, error: BaseException) -> None:
        self._add(channel, error)

    def _add(self, channel: ChunkChannel, item: object) -> None:
        items = self._posts.get(channel._mailbox)
        if items is None:
            items = self._posts[channel._mailbox] = []
        items.append((channel, item))

    def post(self) -> None:
        posts, self._posts = self._posts, {}
        for mailbox, items in posts.items():
            mailbox.post_many(items)


class ChunkChannel:
    """One request's chunks, engine thread -> event loop. Unbounded on purpose: the engine never
    waits on a client; the gateway's per-session queue applies the backpressure."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._mailbox = _Mailbox.of(self._loop)
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._started = False  # an item was delivered (the mailbox puts first items first)
        self._listener: ChunkListener | None = None

    # -- producer side (any thread) --------------------------------------------------------
    def put(self, chunk: AudioChunk) -> None:
        self._mailbox.post(self, chunk)

    def finish(self) -> None:
        self._mailbox.post(self, _END)

    def fail(self, error: BaseException) -> None:
        self._mailbox.post(self, error)

    # -- consumer side (event loop) --------------------------------------------------------
    def _push(self, item: object) -> None:
        if self._closed:
            return
        self._started = True
        if self._listener is not None:
            self._closed = _hand(self._listener, item)
            return
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """Consumer gives up: drop what is queued and end iteration."""
        self._mailbox.on_loop(self._close)

    def _close(self) -> None:
        if self._listener is not None:
            if not self._closed:
                self._listener.end()
            self._closed = True
            return
        self._closed = True
        self._items.clear()
        self._items.append(_END)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def listen(self, listener: ChunkListener) -> None:
        """Hand items to `listener` from now on (what is queued first), instead of iterating."""
        self._mailbox.on_loop(lambda: self._listen(listener))

    def _listen(self, listener: ChunkListener) -> None:
        if self._mailbox.after_batch is not None:  # later items skip the mailbox: its ones go first
            taken = self._mailbox.take(self)
            self._started = self._started or bool(taken)
            self._items += taken
        self._listener = listener
        if _hand_queued(listener, self._items):
            self._closed = True

    def pending(self) -> int:
        return len(self._items)

    def __aiter__(self) -> _ChannelIterator:
        return _ChannelIterator(self)

    async def _iterate(self) -> AsyncIterator[AudioChunk]:
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


class _ChannelIterator:
    """What `ChunkChannel.__aiter__` returns: iterates the channel, and lets `listen` find it."""

    def __init__(self, channel: ChunkChannel) -> None:
        self.channel = channel
        self._items: AsyncIterator[AudioChunk] | None = None

    def __aiter__(self) -> _ChannelIterator:
        return self

    def __anext__(self) -> Awaitable[AudioChunk]:
        if self._items is None:
            self._items = self.channel._iterate()
        return self._items.__anext__()


_LOOP_END = None  # in a LoopChunkChannel: the end of the chunks


class LoopChunkChannel:
    """One stream's chunks, fed from the event loop itself (no thread hop, no self-pipe wake-up),
    and iterated without a generator: `__anext__` hands out a future, already done when a chunk
    waits. Like ChunkChannel: unbounded; `close()` drops what is queued and ends the
    iteration; an error ends it by raising."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._items: deque[AudioChunk | BaseException | None] = deque()
        self._waiter: asyncio.Future[AudioChunk] | None = None
        self._closed = False  # the consumer gave up: nothing more is queued
        self._ended = False  # the end (or an error) was handed out
        self._listener: ChunkListener | None = None

    def put(self, chunk: AudioChunk) -> None:
        self._push(chunk)

    def finish(self) -> None:
        self._push(_LOOP_END)

    def fail(self, error: BaseException) -> None:
        self._push(error)

    def close(self) -> None:
        self._items.clear()
        self._push(_LOOP_END)
        self._closed = True

    def listen(self, listener: ChunkListener) -> None:
        """Hand items to `listener` from now on (what is queued first), instead of iterating."""
        self._listener = listener
        if _hand_queued(listener, self._items):
            self._closed = True

    def _push(self, item: AudioChunk | BaseException | None) -> None:
        if self._closed:
            return
        if self._listener is not None:
            self._closed = _hand(self._listener, item)
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            self._hand(waiter, item)
        else:
            self._items.append(item)

    def _hand(self, future: asyncio.Future[AudioChunk], item: AudioChunk | BaseException | None) -> None:
        if isinstance(item, AudioChunk):
            self._ended = item.final
            future.set_result(item)
            return
        self._ended = True
        if item is None:
            future.set_exception(StopAsyncIteration())
        else:
            future.set_exception(item if isinstance(item, EngineError) else EngineError(str(item)))

    def __aiter__(self) -> LoopChunkChannel:
        return self

    def __anext__(self) -> asyncio.Future[AudioChunk]:
        if self._ended:
            raise StopAsyncIteration
        future = self._loop.create_future()
        if self._items:
            self._hand(future, self._items.popleft())
        else:
            self._waiter = future
        return future
