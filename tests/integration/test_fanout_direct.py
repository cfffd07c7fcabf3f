"""Over real uvicorn: what the direct frame writer sends decodes with the websockets client exactly
as what the per-message ASGI path sends (same messages, same packet bytes, same order), with and
without permessage-deflate; and many concurrent real-time streams keep every packet's order."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine.null import NullEngine
from gateway import server
from gateway.messages import unpack_packet
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory
from tests.integration.wsclient import connect

pytestmark = pytest.mark.timeout(60)

TEXT = "Sure, I can help you with that. It will only take a moment."


async def session_frames(url: str, compression: str | None, pacing: str = "asap") -> list[Any]:
    """Every frame of one session, JSON decoded (session_id dropped), packets as bytes."""
    frames: list[Any] = []
    async with connect(url, compression=compression) as ws:
        for message in (
            {"type": "session.start", "pacing": pacing},
            {"type": "speak.append", "utterance_id": "u1", "text": TEXT},
            {"type": "speak.end", "utterance_id": "u1"},
            {"type": "session.end"},
        ):
            await ws.send(json.dumps(message))
        async for frame in ws:
            if isinstance(frame, str):
                message = json.loads(frame)
                message.pop("session_id", None)
                frames.append(message)
            else:
                frames.append(frame)
    return frames


@pytest.mark.parametrize("compression", ["deflate", None])
async def test_direct_frames_decode_exactly_as_the_asgi_path(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch, compression: str | None
) -> None:
    direct = gateway_factory(FakeEngine())
    got_direct = await session_frames(direct.ws, compression)
    monkeypatch.setattr(server, "FRAME_WRITER", "not offered")  # sessions fall back to the ASGI path
    generic = gateway_factory(FakeEngine())
    got_generic = await session_frames(generic.ws, compression)
    assert got_direct == got_generic
    packets = [unpack_packet(f)[0] for f in got_direct if isinstance(f, bytes)]
    assert len(packets) > 20 and [p.seq for p in packets] == list(range(len(packets)))
    assert got_direct[-1] == {"type": "session.ended"}


@pytest.mark.parametrize("offered", [True, False])
async def test_the_direct_path_is_taken_under_uvicorn_unless_not_offered(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch, offered: bool
) -> None:
    if not offered:
        monkeypatch.setattr(server, "FRAME_WRITER", "not offered")
    gateway = gateway_factory(FakeEngine())
    async with connect(gateway.ws) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await ws.recv()
        (session,) = gateway.server.gateway.sessions
        writer = session._writer
        assert (writer is not None) is offered
        if writer is not None:
            assert writer.open and writer.writable


async def test_many_realtime_streams_keep_order_and_pacing(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(NullEngine())

    async def one(i: int) -> tuple[list[int], float, float]:
        seqs: list[int] = []
        loop = asyncio.get_running_loop()
        async with connect(gateway.ws, compression=None) as ws:
            for message in (
                {"type": "session.start", "pacing": "realtime", "timestamps": "none"},
                {"type": "speak.append", "utterance_id": "u", "text": "Hello there, friend."},
                {"type": "speak.end", "utterance_id": "u"},
            ):
                await ws.send(json.dumps(message))
            first = last = 0.0
            async for frame in ws:
                if isinstance(frame, bytes):
                    seqs.append(unpack_packet(frame)[0].seq)
                    first = first or loop.time()
                    last = loop.time()
                elif json.loads(frame)["type"] == "utterance.done":
                    break
        return seqs, first, last

    results = await asyncio.gather(*(one(i) for i in range(20)))
    for seqs, first, last in results:
        assert seqs == list(range(len(seqs))) and len(seqs) > 50
        audio_s = len(seqs) * 0.02
        assert last - first >= audio_s - 0.3 - 0.05  # real time: never more than the lead ahead
