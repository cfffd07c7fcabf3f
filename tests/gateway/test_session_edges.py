"""Edges of the session contract (docs/protocol.md): output sizes sent as JSON floats, the
utterance an unknown type named, the idle timeout beside a pause, and queued_ms on an
utterance.done a pause held back past its stream's end."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.packets import Packet
from gateway.protocol import Close
from gateway.session import Session
from tests.gateway.test_fanout_pump import FakeSocket, FakeStream, FakeWriter, OneStreamEngine, settle
from tests.gateway.test_pause import PauseHarness
from tests.gateway.test_protocol import Harness, spoken


def test_output_sizes_sent_as_json_floats_still_make_packets() -> None:
    """24000.0 is the number 24000: the session is served at that rate, not failed at its first
    chunk."""
    h = Harness()
    h.send(type="session.start", output={"sample_rate": 24000.0, "packet_ms": 20.0})
    output = h.control[0]["output"]
    assert output == {
        "encoding": "pcm_s16le",
        "sample_rate": 24000,
        "packet_ms": 20,
        "samples_per_packet": 480,
    }
    assert all(type(output[k]) is int for k in ("sample_rate", "packet_ms", "samples_per_packet"))
    h.say("u1", "Sure, I can help you with that.")
    h.speak_words("u1", ["Sure,"], ms_each=50, final=True)
    packets = [item for _, item in h.audio if isinstance(item, Packet)]
    assert [p.samples for p in packets] == [480, 480, 240]
    assert h.errors() == []


def test_an_unknown_type_error_names_the_utterance_its_message_named() -> None:
    """Every error carries utterance_id when the message named one."""
    h = Harness()
    h.send(type="speak.apend", utterance_id="u1", text="Hello.")
    assert h.errors() == [("unknown_type", "u1")]


def test_the_idle_timeout_does_not_close_a_session_whose_utterance_is_paused() -> None:
    """A delivered utterance may be paused (its listener still plays it): that pause is in
    progress until its unpause or its own timeout, so the idle timeout leaves the session open."""
    h = PauseHarness(GatewayConfig(idle_timeout_s=300.0))
    h.send(type="session.start", pause_timeout_ms=600_000)
    spoken(h)
    h.speak_words("u1", [], final=True)
    h.deliver()
    h.now = 1.0
    h.send(type="speak.pause", utterance_id="u1")
    h.run(h.p.tick(h.now + 301.0))
    assert h.closes == [] and not h.p.closed
    h.now += 302.0
    h.send(type="speak.unpause", utterance_id="u1")
    assert h.of_type("utterance.unpaused") == [{"type": "utterance.unpaused", "utterance_id": "u1"}]
    # with nothing in progress any more, the idle timeout applies again
    assert any(isinstance(a, Close) for a in h.p.tick(h.now + 301.0))


class QueuedStream(FakeStream):
    def queue_wait_s(self) -> float:
        return 0.5


class QueuedEngine(OneStreamEngine):
    """Every stream waited half a second for admission."""

    def open(self, request: Any) -> FakeStream:
        stream = QueuedStream(request.request_id)
        self.streams[request.request_id.split("/")[1]] = stream
        return stream


def _receive(socket: FakeSocket, **message: Any) -> None:
    socket.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(message)})


@pytest.mark.parametrize("pause", [False, True])
async def test_utterance_done_says_how_long_it_waited_also_after_a_pause(pause: bool) -> None:
    """utterance.done carries queued_ms also when a pause holds it back past the end of the engine
    stream (whose wait the session asks); without a pause it is the control."""
    writer = FakeWriter()
    socket = FakeSocket(writer)
    engine = QueuedEngine()
    session = Session(socket, engine, GatewayConfig(), GatewayMetrics())  # type: ignore[arg-type]
    task = asyncio.create_task(session.run())
    try:
        _receive(socket, type="speak.append", utterance_id="u1", text="Hello there.")
        await settle()
        stream = engine.streams["u1"]
        stream.chunk(480 * 3)
        await settle()
        if pause:
            _receive(socket, type="speak.pause", utterance_id="u1")
            await settle()
        stream.chunk(480, final=True)
        stream.queue.put_nowait(None)  # the engine stream ends while the utterance is paused
        await settle()
        if pause:
            _receive(socket, type="speak.unpause", utterance_id="u1")
            await settle()
        done = [json.loads(f) for f in writer.frames if isinstance(f, str) and "utterance.done" in f]
        assert done == [
            {
                "type": "utterance.done",
                "utterance_id": "u1",
                "duration_ms": 80,
                "packets": 4,
                "queued_ms": 500,
            }
        ]
        assert session._clocks == {}  # nothing kept once the trailer went
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
