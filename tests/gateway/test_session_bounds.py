"""Long-running sessions keep bounded state: history entries without resampler state, bounded
Python memory over 1 000 utterances, and a watchdog that times blocked sends only."""

from __future__ import annotations

import asyncio
import gc
import json
import tracemalloc
from typing import Any

import numpy as np

from engine.api import AudioChunk, EngineInfo, WordTiming
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.packets import Packet
from gateway.protocol import OpenStream, SendAudio, SendTrailer, SessionProtocol
from gateway.session import Session

TEXT = "Your order has shipped and should arrive on Thursday."


def _serve(p: SessionProtocol, uid: str, chunks: int = 10, size: int = 2400) -> None:
    """One whole utterance: text, engine chunks with words, every packet and the trailer sent."""
    actions = p.receive_text(json.dumps({"type": "speak.append", "utterance_id": uid, "text": TEXT}), 0.0)
    actions += p.receive_text(json.dumps({"type": "speak.end", "utterance_id": uid}), 0.0)
    assert any(isinstance(a, OpenStream) for a in actions)
    p.open_succeeded(uid)
    out = []
    for k in range(chunks):
        word = WordTiming("word", k * size, (k + 1) * size, 0, 4)
        out += p.receive_chunk(uid, AudioChunk(uid, np.full(size, 0.1, np.float32), k * size, (word,)))
    out += p.receive_chunk(uid, AudioChunk(uid, np.zeros(0, np.float32), chunks * size, (), final=True))
    for a in out:
        if isinstance(a, SendAudio):
            for packet in a.packets:
                assert packet.frame
                p.packet_sent(a.stream, packet, 0.0)
        elif isinstance(a, SendTrailer):
            p.trailer_sent(a.stream)
    assert p.active_count == 0


def _protocol(rate: int = 24000, output: dict[str, Any] | None = None) -> SessionProtocol:
    p = SessionProtocol("s", EngineInfo("fake", "tones", rate), GatewayConfig())
    p.receive_text(json.dumps({"type": "session.start", "output": output or {}}), 0.0)
    return p


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def test_a_thousand_utterances_keep_python_memory_bounded() -> None:
    p = _protocol()
    tracemalloc.start()
    try:
        for i in range(100):
            _serve(p, f"u{i}", chunks=4)
        gc.collect()
        after_100 = tracemalloc.get_traced_memory()[0]
        for i in range(100, 1100):
            _serve(p, f"u{i}", chunks=4)
        gc.collect()
        after_1100 = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after_1100 - after_100 < 32 * 1024, (after_100, after_1100)
    # the history is bounded and still answers a late cancel of a recent utterance
    assert p.utterance("u1099") is not None and p.utterance("u10") is None


def test_retired_utterances_hold_no_resampler_state() -> None:
    """A soxr stream is 70-110 KB outside Python's heap: 40 sessions' full histories at 48 kHz
    (1 280 retired utterances) would hold well over 80 MB if retirement kept them."""
    gc.collect()
    before = _rss_mb()
    sessions = [_protocol(output={"sample_rate": 48000, "packet_ms": 100}) for _ in range(40)]
    for n, p in enumerate(sessions):
        for i in range(40):
            _serve(p, f"s{n}u{i}", chunks=3)
    gc.collect()
    grown = _rss_mb() - before
    assert grown < 40, f"RSS grew {grown:.0f} MB"
    retired = sessions[0].utterance("s0u39")
    assert retired is not None and retired.sent_ms == 300 and retired.packetiser.packets == 3


class _BlockingSocket:
    """Sends wait until the client 'reads' (the event is set)."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.sent: list[bytes | str] = []

    async def send_bytes(self, data: bytes) -> None:
        await self.reading.wait()
        self.sent.append(data)

    async def send_text(self, data: str) -> None:
        await self.reading.wait()
        self.sent.append(data)


async def test_watchdog_times_blocked_sends_not_idle_writers() -> None:
    config = GatewayConfig(slow_client_timeout_s=10.0)
    socket = _BlockingSocket()
    session = Session(socket, _Engine(), config, GatewayMetrics())  # type: ignore[arg-type]
    now = asyncio.get_running_loop().time()
    # audio queued after a long idle stretch (engine queueing, a starved event loop): not a stall
    session.queue.put_audio([_packet()])
    assert session.send_blocked_for(now + 60) == 0.0 and session.too_slow(now + 60) is None
    # a send that the client does not take for longer than the timeout is one
    send = asyncio.create_task(session._send(b"frame"))
    await asyncio.sleep(0)
    assert session.too_slow(now + 5) is None
    assert session.too_slow(now + 11) is not None
    socket.reading.set()
    await send
    assert socket.sent == [b"frame"] and session.too_slow(now + 100) is None


class _Engine:
    info = EngineInfo("fake", "tones", 24000)


def _packet() -> Packet:
    p = _protocol()
    actions = p.receive_text(json.dumps({"type": "speak.append", "utterance_id": "u", "text": "hi"}), 0.0)
    assert actions
    p.open_succeeded("u")
    out = p.receive_chunk("u", AudioChunk("u", np.zeros(480, np.float32), 0, (), final=True))
    return next(a.packets[0] for a in out if isinstance(a, SendAudio))
