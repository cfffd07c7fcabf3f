"""Chunks from an engine thread to the event loop: in order per channel, errors and ends kept, and
one wake-up of the loop for a burst of chunks over many channels."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from engine.api import AudioChunk, EngineError
from engine.bridge import ChunkChannel


def chunk(rid: str, offset: int) -> AudioChunk:
    return AudioChunk(rid, np.zeros(4, np.float32), offset)


async def test_a_burst_over_many_channels_wakes_the_loop_once_and_keeps_each_channels_order() -> None:
    loop = asyncio.get_running_loop()
    channels = [ChunkChannel() for _ in range(10)]
    wakes = 0
    real = loop.call_soon_threadsafe

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal wakes
        wakes += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        def engine_step() -> None:  # a step handing out ten chunks per channel, then the ends
            for offset in range(10):
                for i, ch in enumerate(channels):
                    ch.put(chunk(f"r{i}", offset))
            for ch in channels:
                ch.finish()

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # the loop did not run meanwhile: everything waits in the mailbox
        got = [[c.sample_offset async for c in ch] for ch in channels]
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert got == [list(range(10))] * 10
    assert wakes == 1


async def test_a_failure_reaches_the_consumer_after_the_chunks_before_it() -> None:
    ch = ChunkChannel()
    thread = threading.Thread(target=lambda: (ch.put(chunk("a", 0)), ch.fail(EngineError("gpu fell over"))))
    thread.start()
    thread.join()
    seen = []
    with pytest.raises(EngineError, match="gpu fell over"):
        async for c in ch:
            seen.append(c.sample_offset)
    assert seen == [0]


async def test_items_posted_while_the_loop_delivers_come_in_a_later_batch() -> None:
    ch = ChunkChannel()
    first_batch = threading.Event()
    received = []

    def engine() -> None:
        ch.put(chunk("a", 0))
        first_batch.wait(5)
        ch.put(chunk("a", 1))
        ch.finish()

    thread = threading.Thread(target=engine)
    thread.start()
    async for c in ch:
        received.append(c.sample_offset)
        first_batch.set()
    thread.join()
    assert received == [0, 1]


def test_a_put_after_the_loop_closed_is_dropped_without_raising() -> None:
    loop = asyncio.new_event_loop()
    ch = ChunkChannel(loop)
    loop.close()
    ch.put(chunk("a", 0))  # the engine thread must not die because its consumer's loop is gone
    ch.finish()
