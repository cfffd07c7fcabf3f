"""An utterance's engine audio handed over without a task: straight to the session while its lane
has room, held in order while it has none (the engine never waits), exactly one end or failure,
nothing after a close; and a session listens to every stream that can be listened to."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from engine.api import AudioChunk, EngineError, SynthesisRequest, SynthesisStream, TextSegment
from engine.null import NullEngine
from gateway.stream_listener import StreamListener

pytestmark = pytest.mark.timeout(30)


def chunk(offset: int, final: bool = False) -> AudioChunk:
    return AudioChunk("u", np.zeros(480, np.float32), offset, final=final)


class Record:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.room = asyncio.Event()
        self.room.set()

    def listener(self) -> StreamListener:
        return StreamListener(
            lambda c: self.events.append(c.sample_offset),
            lambda: self.events.append("end"),
            lambda e: self.events.append(("failed", str(e))),
            self.room,
        )


async def test_chunks_go_straight_through_while_there_is_room() -> None:
    r = Record()
    listener = r.listener()
    listener.chunk(chunk(0))
    listener.chunk(chunk(480))
    assert r.events == [0, 480]  # at once: no task in between
    listener.end()
    listener.chunk(chunk(960))  # after the end: nothing
    assert r.events == [0, 480, "end"]


async def test_without_room_chunks_wait_in_order_and_go_on_when_room_comes() -> None:
    r = Record()
    listener = r.listener()
    listener.chunk(chunk(0))
    r.room.clear()
    for k in range(1, 4):
        listener.chunk(chunk(480 * k))
    listener.end()
    await asyncio.sleep(0.01)
    assert r.events == [0]  # held: the lane is full
    r.room.set()
    listener.chunk(chunk(480 * 4))  # room again, but held items go first
    await asyncio.sleep(0.01)
    assert r.events == [0, 480, 960, 1440, "end"]  # the chunk after the end is dropped


async def test_a_close_drops_what_waits_and_whatever_comes_after() -> None:
    r = Record()
    listener = r.listener()
    r.room.clear()
    listener.chunk(chunk(0))
    listener.close()
    r.room.set()
    listener.chunk(chunk(480))
    listener.fail(EngineError("late"))
    await asyncio.sleep(0.01)
    assert r.events == []


async def test_a_chunk_the_session_cannot_take_fails_the_utterance_once() -> None:
    events: list[Any] = []

    def take(c: AudioChunk) -> None:
        raise ValueError("bad chunk")

    room = asyncio.Event()
    room.set()
    listener = StreamListener(take, lambda: events.append("end"), lambda e: events.append(repr(e)), room)
    listener.chunk(chunk(0))
    listener.chunk(chunk(480))
    listener.end()
    assert events == ["ValueError('bad chunk')"] and listener.closed


async def test_engine_streams_of_the_bridge_are_listened_to() -> None:
    engine = NullEngine(chunk_ms=80, speed=8.0)
    await engine.start()
    try:
        r = Record()
        stream = engine.open(SynthesisRequest("s/u"))
        assert stream.listen(r.listener())
        stream.push(TextSegment("one two", 0))
        stream.close_text()
        for _ in range(100):
            if r.events and r.events[-1] == "end":
                break
            await asyncio.sleep(0.01)
        assert r.events[-1] == "end" and r.events[:3] == [0, 1920, 3840]
    finally:
        await engine.stop()


async def test_a_stream_that_is_only_iterable_is_not_listened_to() -> None:
    class Iterable(SynthesisStream):  # listen() as SynthesisStream declines
        async def __aiter__(self) -> Any:
            yield chunk(0)

    assert not Iterable().listen(Record().listener())


async def test_a_throttled_stream_holds_its_chunks_until_throttled_off() -> None:
    r = Record()
    listener = r.listener()
    listener.chunk(chunk(0))
    listener.throttle(True)
    listener.chunk(chunk(480))
    listener.chunk(chunk(960, final=True))
    listener.end()
    await asyncio.sleep(0.01)
    assert r.events == [0]  # room in the lane, but held back
    listener.throttle(True)  # again: still held
    await asyncio.sleep(0.01)
    assert r.events == [0]
    listener.throttle(False)
    await asyncio.sleep(0.01)
    assert r.events == [0, 480, 960, "end"]
    listener.chunk(chunk(1440))
    assert r.events == [0, 480, 960, "end"]
