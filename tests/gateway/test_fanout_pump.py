"""The direct send path: frames framed by the gateway equal the websockets library's, a session's
pump writes everything that may go in one write (control first, order kept, the barge-in fence
held, realtime pacing respected), and what it cannot do (close, a full transport, text that is not
UTF-8) goes to the writer task."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
from typing import Any

import numpy as np
import pytest
from websockets.frames import Frame, Opcode

from engine.api import AudioChunk, EngineInfo, SynthesisRequest, SynthesisStream
from gateway.config import GatewayConfig
from gateway.messages import unpack_packet
from gateway.metrics import GatewayMetrics
from gateway.pacer import Pacer
from gateway.packets import Packet
from gateway.protocol import SendAudio
from gateway.server import frame_header
from gateway.session import FRAME_WRITER, Session

pytestmark = pytest.mark.timeout(30)
TICK_MS = 40  # the pacing grid of the realtime tests (two 20 ms packets a tick)
PACING_TICK_S = TICK_MS / 1000


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 972, 4095, 4096, 65535, 65536, 70_000])
@pytest.mark.parametrize("opcode", [Opcode.TEXT, Opcode.BINARY])
def test_frame_header_matches_the_websockets_library(size: int, opcode: Opcode) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert frame_header(opcode.value, size) + data == Frame(opcode, data).serialize(mask=False, extensions=[])


class FakeWriter:
    """Records each transport write as the list of messages it carried."""

    def __init__(self) -> None:
        self.writes: list[list[bytes | str]] = []
        self.open = True
        self.writable = True
        self.resumed = asyncio.Event()

    async def wait_writable(self) -> None:
        await self.resumed.wait()
        self.writable = True

    def write(self, messages: Any) -> None:
        self.writes.append(list(messages))

    @property
    def frames(self) -> list[bytes | str]:
        return [m for w in self.writes for m in w]


class FakeSocket:
    def __init__(self, writer: FakeWriter | None) -> None:
        self.scope = {"extensions": {FRAME_WRITER: writer} if writer else {}}
        self.sent: list[bytes | str] = []
        self.closed: tuple[int, str] | None = None
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.application_state = None

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        text.encode()  # as uvicorn does: raises for text that is not UTF-8
        self.sent.append(text)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class OneStreamEngine:
    """Hands out streams whose chunks the test pushes (nothing runs by itself)."""

    info = EngineInfo("fake", "tones", 24000)

    def __init__(self) -> None:
        self.streams: dict[str, FakeStream] = {}

    def open(self, request: SynthesisRequest) -> FakeStream:
        stream = FakeStream(request.request_id)
        self.streams[request.request_id.split("/")[1]] = stream
        return stream


class FakeStream(SynthesisStream):
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[AudioChunk | None] = asyncio.Queue()
        self.cancelled = False
        self.sent = 0

    def push(self, segment: Any) -> None: ...

    def close_text(self) -> None: ...

    def cancel(self) -> None:
        self.cancelled = True
        self.queue.put_nowait(None)

    def chunk(self, samples: int, final: bool = False) -> None:
        self.queue.put_nowait(
            AudioChunk(self.request_id, np.full(samples, 0.25, np.float32), self.sent, (), final)
        )
        self.sent += samples

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> AudioChunk:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        return item


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def start(
    pacing: str = "asap", writer: FakeWriter | None = None, **config: Any
) -> tuple[Session, FakeSocket, FakeWriter | None, OneStreamEngine, asyncio.Task[None]]:
    socket = FakeSocket(writer)
    engine = OneStreamEngine()
    session = Session(socket, engine, GatewayConfig(**config), GatewayMetrics())  # type: ignore[arg-type]
    task = asyncio.create_task(session.run())
    await socket.inbox.put(
        {
            "type": "websocket.receive",
            "text": json.dumps({"type": "session.start", "pacing": pacing, "timestamps": "none"}),
        }
    )
    await settle()
    return session, socket, writer, engine, task


def say(socket: FakeSocket, uid: str, text: str = "Hello there.") -> None:
    socket.inbox.put_nowait(
        {
            "type": "websocket.receive",
            "text": json.dumps({"type": "speak.append", "utterance_id": uid, "text": text}),
        }
    )


async def realtime_stream(samples: int, **config: Any) -> tuple[FakeWriter, FakeStream, asyncio.Task[None]]:
    """A realtime-paced session on the direct path whose one utterance got `samples` at once."""
    writer = FakeWriter()
    _, socket, _, engine, task = await start("realtime", writer, **config)
    say(socket, "u1")
    await settle()
    stream = engine.streams["u1"]
    stream.chunk(samples)
    await settle()
    return writer, stream, task


def packets_per_write(writer: FakeWriter, since: int) -> list[int]:
    """Packets in each write from the `since`-th on (writes of text alone left out)."""
    counts = [sum(isinstance(m, bytes) for m in w) for w in writer.writes[since:]]
    return [n for n in counts if n]


def kinds(frames: list[bytes | str]) -> list[Any]:
    """JSON messages by type, packets as (stream, seq)."""
    out: list[Any] = []
    for f in frames:
        if isinstance(f, str):
            out.append(json.loads(f)["type"])
        else:
            header, _ = unpack_packet(f)
            out.append((header.stream, header.seq))
    return out


async def test_a_chunk_of_packets_goes_out_in_one_write_in_order() -> None:
    session, socket, writer, engine, task = await start(writer=FakeWriter())
    assert writer is not None
    say(socket, "u1")
    await settle()
    before = len(writer.writes)
    engine.streams["u1"].chunk(480 * 5)
    await settle()
    assert len(writer.writes) == before + 1  # five packets, one transport write
    assert kinds(writer.writes[-1]) == [(1, i) for i in range(5)]
    assert socket.sent == []  # nothing went through the per-message ASGI path
    assert kinds(writer.frames)[:2] == ["session.started", "utterance.started"]
    task.cancel()


async def test_control_messages_go_ahead_of_queued_audio_and_the_fence_holds() -> None:
    session, socket, writer, engine, task = await start(writer=FakeWriter())
    assert writer is not None
    say(socket, "u1")
    await settle()
    writer.writable = False  # the client stops reading: audio queues up
    engine.streams["u1"].chunk(480 * 4)
    await settle()
    assert session.queue.audio and not any(isinstance(f, bytes) for f in writer.frames)
    socket.inbox.put_nowait(
        {"type": "websocket.receive", "text": json.dumps({"type": "speak.cancel", "utterance_id": "u1"})}
    )
    await settle()
    writer.resumed.set()
    await settle()
    got = kinds(writer.frames)
    assert "utterance.interrupted" in got
    assert not any(isinstance(k, tuple) for k in got)  # the purge dropped every queued packet
    engine.streams["u1"].chunk(480)  # a late chunk after the fence is dropped too
    await settle()
    assert not any(isinstance(k, tuple) for k in kinds(writer.frames))
    task.cancel()


async def test_packets_sent_before_a_cancel_precede_the_interruption_and_none_follow() -> None:
    session, socket, writer, engine, task = await start(writer=FakeWriter())
    assert writer is not None
    say(socket, "u1")
    say(socket, "u2", "And more.")
    await settle()
    engine.streams["u1"].chunk(480 * 2)
    engine.streams["u2"].chunk(480 * 2)
    await settle()
    socket.inbox.put_nowait(
        {"type": "websocket.receive", "text": json.dumps({"type": "speak.cancel", "utterance_id": "u1"})}
    )
    await settle()
    engine.streams["u2"].chunk(480, final=True)
    await settle()
    got = kinds(writer.frames)
    fence = got.index("utterance.interrupted")
    assert [k for k in got[:fence] if isinstance(k, tuple) and k[0] == 1] == [(1, 0), (1, 1)]
    assert not [k for k in got[fence:] if isinstance(k, tuple) and k[0] == 1]
    assert [k for k in got if isinstance(k, tuple) and k[0] == 2] == [(2, 0), (2, 1), (2, 2)]
    assert got[-1] == "utterance.done"  # u2's trailer, behind its last packet
    task.cancel()


async def test_realtime_pacing_holds_packets_to_the_lead_and_releases_them_on_the_shared_tick() -> None:
    loop = asyncio.get_running_loop()
    writer, _, task = await realtime_stream(
        480 * 25, realtime_lead_ms=100, pacing_tick_ms=TICK_MS
    )  # 500 ms at once
    t0 = loop.time()

    def packets() -> list[Any]:
        return [k for k in kinds(writer.frames) if isinstance(k, tuple)]

    # packet 0, then the 100 ms of lead as judged at the grid's last tick: packets 1..5 at most,
    # and at least those due a tick before
    assert 6 - round(PACING_TICK_S / 0.02) <= len(packets()) <= 6
    assert Pacer.of(loop)._timer is not None  # one shared timer waits for the rest
    await asyncio.sleep(0.2 + 1.5 * PACING_TICK_S)
    sent = len(packets())
    elapsed = loop.time() - t0
    assert sent <= 6 + int(elapsed / 0.02 + 1)  # never ahead of the lead
    assert sent >= 6 + int((elapsed - PACING_TICK_S) / 0.02) - 2  # late by about one tick at most
    await asyncio.sleep(0.4 + PACING_TICK_S)
    assert len(packets()) == 25
    per_write = [n for n in (sum(isinstance(m, bytes) for m in w) for w in writer.writes) if n]
    first_burst = next(i for i in range(len(per_write)) if sum(per_write[: i + 1]) >= 6)
    assert max(per_write[first_burst + 1 :]) >= 2  # a tick's due packets share one write
    task.cancel()


async def test_paced_audio_goes_on_the_tick_even_when_news_comes_between_ticks() -> None:
    """An engine ahead of real time hands chunks over every few ms: each one pumps the session,
    but audio that was not due at the grid's last tick waits for the next, so every write after
    the start carries a whole tick's packets (two of 20 ms), not one packet per wake-up."""
    # 200 ms at once: the start and its lead
    writer, stream, task = await realtime_stream(480 * 10, realtime_lead_ms=100, pacing_tick_ms=TICK_MS)
    writes_at_start = len(writer.writes)
    for _ in range(60):  # then 20 ms every 5 ms (four times real time) for 300 ms
        stream.chunk(480)
        await asyncio.sleep(0.005)
    per_write = packets_per_write(writer, writes_at_start)
    assert len(per_write) >= 5
    assert min(per_write) >= 2, per_write
    task.cancel()


async def test_the_default_grid_writes_a_realtime_stream_five_packets_at_a_time() -> None:
    """Default settings (300 ms of lead, a 100 ms grid): after the start, each write carries the
    five 20 ms packets that came due in one tick, and the client is never less than 200 ms ahead
    of its clock (the lead minus one tick)."""
    config = GatewayConfig()
    assert (config.realtime_lead_ms, config.pacing_tick_ms) == (300, 100)
    loop = asyncio.get_running_loop()
    writer, _, task = await realtime_stream(480 * 60)  # 1.2 s of audio at once
    t0 = loop.time()
    writes_at_start = len(writer.writes)
    sent_by: list[tuple[float, int]] = []
    for _ in range(40):  # 0.6 s: six ticks
        await asyncio.sleep(0.015)
        sent_by.append((loop.time() - t0, len([k for k in kinds(writer.frames) if isinstance(k, tuple)])))
    per_write = packets_per_write(writer, writes_at_start)
    assert len(per_write) >= 4 and all(n == 5 for n in per_write), per_write
    for elapsed, sent in sent_by:  # packets sent cover the clock plus at least the lead minus a tick
        assert sent * 0.02 >= elapsed + 0.2 - 0.03, (elapsed, sent)
    task.cancel()


@pytest.mark.parametrize(
    "options", [{"pacing_tick_ms": 0}, {"pacing_tick_ms": 400}, {"realtime_lead_ms": 50}]
)
def test_a_pacing_grid_longer_than_the_lead_is_refused(options: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="pacing_tick_ms"):
        GatewayConfig(**options)  # type: ignore[arg-type]


async def test_a_full_transport_is_waited_out_by_the_writer_task_and_timed_by_the_watchdog() -> None:
    session, socket, writer, engine, task = await start(writer=FakeWriter(), slow_client_timeout_s=10.0)
    assert writer is not None
    say(socket, "u1")
    await settle()
    writer.writable = False
    engine.streams["u1"].chunk(480 * 3)
    await settle()
    now = asyncio.get_running_loop().time()
    assert session.send_blocked_for(now + 5) > 4.9  # the writer task waits on the transport
    assert session.too_slow(now + 11) is not None
    writer.resumed.set()
    await settle()
    assert session.send_blocked_for(now + 100) == 0.0
    assert [k for k in kinds(writer.frames) if isinstance(k, tuple)] == [(1, 0), (1, 1), (1, 2)]
    task.cancel()


async def test_text_that_is_not_utf8_takes_the_asgi_path_which_refuses_it() -> None:
    session, socket, writer, engine, task = await start(writer=FakeWriter())
    assert writer is not None
    writes = len(writer.writes)
    session.queue.put_control('{"type":"x","bad":"\udcff"}')
    session.queue.put_control('{"type":"after"}')
    await settle()
    assert task.done() and task.exception() is None  # the writer task failed: run() ended the session
    assert len(writer.writes) == writes  # nothing after the bad frame went out
    assert socket.sent == []


async def test_a_close_goes_after_the_messages_before_it() -> None:
    closed: list[tuple[int, str]] = []
    session, socket, writer, engine, task = await start(writer=FakeWriter())
    assert writer is not None

    async def close(code: int, reason: str) -> None:
        closed.append((code, reason))

    from starlette.websockets import WebSocketState

    socket.application_state = WebSocketState.CONNECTED  # type: ignore[assignment]
    socket.close = close  # type: ignore[attr-defined]
    socket.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps({"type": "session.end"})})
    await asyncio.wait_for(task, 5)
    assert kinds(writer.frames)[-1] == "session.ended"
    assert closed == [(1000, "session ended")]


async def test_without_a_frame_writer_every_frame_takes_the_asgi_path() -> None:
    session, socket, _, engine, task = await start(writer=None)
    say(socket, "u1")
    await settle()
    engine.streams["u1"].chunk(480 * 3, final=True)
    await settle()
    got = kinds(socket.sent)
    assert got[:2] == ["session.started", "utterance.started"]
    assert got[2:] == [(1, 0), (1, 1), (1, 2), "utterance.done"]  # the third packet is flagged last
    task.cancel()


async def test_the_asgi_path_paces_realtime_audio_like_the_direct_path() -> None:
    """One writer path: without a frame writer the same frames go, one `send` each, held to the
    lead on the same grid, and a cancel still reaches every packet not yet sent."""
    loop = asyncio.get_running_loop()
    session, socket, _, engine, task = await start(
        "realtime", writer=None, realtime_lead_ms=100, pacing_tick_ms=TICK_MS
    )
    say(socket, "u1")
    await settle()
    engine.streams["u1"].chunk(480 * 25)  # 500 ms at once
    await settle()
    t0 = loop.time()

    def packets() -> list[Any]:
        return [k for k in kinds(socket.sent) if isinstance(k, tuple)]

    assert 6 - round(PACING_TICK_S / 0.02) <= len(packets()) <= 6  # packet 0 and the lead
    await asyncio.sleep(0.2)
    sent = len(packets())
    assert (
        6 + int((loop.time() - t0 - PACING_TICK_S) / 0.02) - 2
        <= sent
        <= 6 + int((loop.time() - t0) / 0.02 + 1)
    )
    socket.inbox.put_nowait(
        {"type": "websocket.receive", "text": json.dumps({"type": "speak.cancel", "utterance_id": "u1"})}
    )
    await settle()
    got = kinds(socket.sent)
    fence = got.index("utterance.interrupted")
    seqs = [k[1] for k in got[:fence] if isinstance(k, tuple)]
    assert seqs == list(range(len(seqs))) and len(seqs) < 25  # in order, and the rest purged
    assert not [k for k in got[fence:] if isinstance(k, tuple)]
    task.cancel()


async def test_paced_packets_wait_in_the_lane_with_nothing_around_them() -> None:
    """Paced packets wait seconds in the lane, and every object alive that long is walked by each
    young collection (whose pause every stream waits through): a waiting packet is held by the
    lane alone, with no wrapper and no protocol action kept alive beside it."""
    session, socket, writer, engine, task = await start("realtime", writer=FakeWriter())
    say(socket, "u1")
    await settle()
    engine.streams["u1"].chunk(480 * 100)  # 2 s of audio: most of it waits for its time
    await settle()
    waiting = [item for item in session.queue.audio if isinstance(item, Packet)]
    assert len(waiting) > 50
    assert not [o for o in gc.get_objects() if type(o) is SendAudio]
    sample = waiting[::10]
    for packet in sample:
        held_by = [
            r
            for r in gc.get_referrers(packet)
            if r is not waiting and r is not sample and not inspect.isframe(r)
        ]
        assert held_by == [session.queue.audio]
    task.cancel()


async def test_a_session_listens_to_a_stream_that_can_be_listened_to_and_lets_go_at_its_end() -> None:
    """The null engine's streams hand their chunks over: no task per utterance. The fake engine's
    stream above can only be iterated: it gets a task (every other test here)."""
    from engine.null import NullEngine

    engine = NullEngine(chunk_ms=80, speed=8.0)
    await engine.start()
    writer = FakeWriter()
    socket = FakeSocket(writer)
    session = Session(socket, engine, GatewayConfig(), GatewayMetrics())  # type: ignore[arg-type]
    task = asyncio.create_task(session.run())
    await socket.inbox.put(
        {
            "type": "websocket.receive",
            "text": json.dumps({"type": "session.start", "pacing": "asap", "timestamps": "none"}),
        }
    )
    say(socket, "u1", "One two three.")
    socket.inbox.put_nowait(
        {"type": "websocket.receive", "text": json.dumps({"type": "speak.end", "utterance_id": "u1"})}
    )
    await settle()
    assert list(session._listeners) == ["u1"] and not session._pulls
    for _ in range(200):
        if "utterance.done" in kinds(writer.frames):
            break
        await asyncio.sleep(0.01)
    got = kinds(writer.frames)
    assert got[-1] == "utterance.done"
    assert [k[1] for k in got if isinstance(k, tuple)] == list(range(sum(isinstance(k, tuple) for k in got)))
    assert not session._listeners and not session._streams
    task.cancel()
    await engine.stop()
