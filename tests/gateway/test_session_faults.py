"""Faults around one utterance's engine stream stay with that utterance: an engine that refuses the
end of the text fails it alone, a chunk the session cannot take cancels the engine stream it gives
up on, and a pause that holds back a queued utterance.done does not count its RTF twice."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine.api import AudioChunk, ChunkListener, SynthesisRequest
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.session import Session
from tests.gateway.test_fanout_pump import FakeSocket, FakeStream, FakeWriter, OneStreamEngine, settle

pytestmark = pytest.mark.timeout(30)


def _receive(socket: FakeSocket, **message: Any) -> None:
    socket.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(message)})


def _messages(writer: FakeWriter, kind: str) -> list[dict[str, Any]]:
    sent = [json.loads(f) for f in writer.frames if isinstance(f, str)]
    return [m for m in sent if m["type"] == kind]


class CloseTextFails(FakeStream):
    def close_text(self) -> None:
        raise RuntimeError("engine lost the stream")


class ListenedStream(FakeStream):
    """Hands its chunks to the session's listener instead of being iterated."""

    listener: ChunkListener | None = None

    def listen(self, listener: ChunkListener) -> bool:
        self.listener = listener
        return True


class Engine(OneStreamEngine):
    """Opens streams of the class each utterance id names (default: an iterated FakeStream)."""

    def __init__(self, kinds: dict[str, type[FakeStream]]) -> None:
        super().__init__()
        self.kinds = kinds

    def open(self, request: SynthesisRequest) -> FakeStream:
        uid = request.request_id.split("/")[1]
        stream = self.kinds.get(uid, FakeStream)(request.request_id)
        self.streams[uid] = stream
        return stream


async def _session(
    engine: Engine, writer: FakeWriter
) -> tuple[Session, FakeSocket, GatewayMetrics, asyncio.Task[None]]:
    socket = FakeSocket(writer)
    metrics = GatewayMetrics()
    session = Session(socket, engine, GatewayConfig(), metrics)  # type: ignore[arg-type]
    task = asyncio.create_task(session.run())
    await settle()
    return session, socket, metrics, task


async def test_an_engine_that_refuses_the_end_of_the_text_fails_only_that_utterance() -> None:
    """close_text raising fails its utterance with a typed error, as a failed push does; the
    session goes on serving the next utterance."""
    writer = FakeWriter()
    engine = Engine({"u1": CloseTextFails})
    session, socket, _, task = await _session(engine, writer)
    try:
        _receive(socket, type="speak.append", utterance_id="u1", text="Hello there.")
        _receive(socket, type="speak.end", utterance_id="u1")
        await settle()
        assert not task.done(), "the session ended with the utterance"
        errors = _messages(writer, "error")
        assert [(e["code"], e["utterance_id"]) for e in errors] == [("internal", "u1")]
        assert engine.streams["u1"].cancelled
        assert session.protocol.active_count == 0

        _receive(socket, type="speak.append", utterance_id="u2", text="Still here.")
        _receive(socket, type="speak.end", utterance_id="u2")
        await settle()
        stream = engine.streams["u2"]
        stream.chunk(480, final=True)
        stream.queue.put_nowait(None)
        await settle()
        assert [m["utterance_id"] for m in _messages(writer, "utterance.done")] == ["u2"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("kind", [FakeStream, ListenedStream], ids=["iterated", "listened"])
async def test_a_chunk_the_session_cannot_take_cancels_the_engine_stream(kind: type[FakeStream]) -> None:
    """The session gives the utterance up (error `internal`) and tells the engine to stop: nobody
    listens to what it would go on making."""
    writer = FakeWriter()
    engine = Engine({"u1": kind})
    session, socket, _, task = await _session(engine, writer)
    try:
        _receive(socket, type="speak.append", utterance_id="u1", text="Hello there.")
        await settle()
        stream = engine.streams["u1"]

        def cannot_take(utterance_id: str, chunk: AudioChunk) -> list[Any]:
            raise RuntimeError("session bug")

        session.protocol.receive_chunk = cannot_take  # type: ignore[method-assign]
        stream.chunk(480)
        if isinstance(stream, ListenedStream):
            assert stream.listener is not None
            stream.listener.chunk(stream.queue.get_nowait())  # type: ignore[arg-type]
        await settle()
        errors = _messages(writer, "error")
        assert [(e["code"], e["utterance_id"]) for e in errors] == [("internal", "u1")]
        assert stream.cancelled
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("pause", [False, True])
async def test_rtf_counts_an_utterance_once_when_a_pause_holds_back_its_queued_done(pause: bool) -> None:
    """utterance.done is queued (its RTF observed) while the client takes no bytes; a pause takes it
    back and the unpause queues it again: still one RTF observation. Without a pause: the control."""
    writer = FakeWriter()
    writer.writable = False  # the transport takes nothing: what is queued stays queued
    engine = Engine({})
    _, socket, metrics, task = await _session(engine, writer)
    try:
        _receive(socket, type="speak.append", utterance_id="u1", text="Hello there.")
        _receive(socket, type="speak.end", utterance_id="u1")
        await settle()
        stream = engine.streams["u1"]
        stream.chunk(480 * 3, final=True)
        stream.queue.put_nowait(None)
        await settle()
        if pause:
            _receive(socket, type="speak.pause", utterance_id="u1")
            await settle()
            _receive(socket, type="speak.unpause", utterance_id="u1")
            await settle()
        writer.resumed.set()
        await settle()
        done = _messages(writer, "utterance.done")
        assert [(m["utterance_id"], m["packets"]) for m in done] == [("u1", 3)]
        assert metrics.registry.get_sample_value("cadence_rtf_count", {"endpoint": "stream"}) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
