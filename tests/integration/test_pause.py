"""speak.pause / speak.unpause over real uvicorn on loopback with the eSpeak engine: pauses at random
points, each utterance checked sample for sample against what the gateway sends of the engine's
audio when nothing pauses it; no packet of the stream between the fence and the unpause; the
pause timeout; the bounded tail."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.messages import PacketHeader
from tests.integration.conftest import GatewayFactory
from tests.integration.recording_engine import RecordingEngine
from tests.integration.wsclient import Client, connect

pytest.importorskip("espeakng_loader")
espeak = pytest.importorskip("engine.espeak.engine")

pytestmark = pytest.mark.timeout(90)

TEXTS = (
    "Sure, I can help you with that today.",
    "The weather looks fine, please hold on while I check.",
    "Your order number is on its way again.",
)


def received(client: Client, uid: str) -> bytes:
    return b"".join(p for _, p in client.got.packets_of(client.got.stream_of(uid)))


def session_id(client: Client) -> str:
    return str(client.got.of_type("session.started")[0]["session_id"])


def audio_ms(client: Client, stream: int, bytes_per_sample: int, rate: int) -> int:
    packets = client.got.packets_of(stream)
    if not packets:
        return 0
    header, payload = packets[-1]
    return (header.sample_offset + len(payload) // bytes_per_sample) * 1000 // rate


async def read_until(client: Client, done: Any, wait_s: float = 20.0) -> None:
    deadline = time.monotonic() + wait_s
    while not done():
        await client.next(max(0.01, deadline - time.monotonic()))


def fenced(
    client: Client, stream: int, start: dict[str, Any], end: dict[str, Any] | None
) -> list[PacketHeader]:
    """The packets of `stream` that arrived between two messages (to the end when `end` is None)."""
    order = client.got.order
    i = next(k for k, item in enumerate(order) if item is start)
    j = len(order) if end is None else next(k for k, item in enumerate(order) if item is end)
    return [h for h in order[i:j] if isinstance(h, PacketHeader) and h.stream == stream]


async def paused_at_random(client: Client, uid: str, text: str, rng: random.Random, rate: int) -> int:
    """Speak `text` with one to three pauses at random points; returns how many were made."""
    await client.send(type="speak.append", utterance_id=uid, text=text)
    await client.send(type="speak.end", utterance_id=uid)
    stream = (await client.until("utterance.started", uid))["stream"]
    estimate_ms = len(text) * 60
    pauses = 0
    for _ in range(rng.randint(1, 3)):
        target = rng.randint(0, estimate_ms)
        finished = lambda: bool(client.got.of_type("utterance.done", uid))  # noqa: E731
        await read_until(client, lambda: finished() or audio_ms(client, stream, 2, rate) >= target)  # noqa: B023
        if finished():
            break
        await client.send(type="speak.pause", utterance_id=uid)
        paused = await client.until("utterance.paused", uid)
        pauses += 1
        await asyncio.sleep(rng.uniform(0.05, 0.4))  # paused: whatever arrives is read
        await client.drain(0.01)
        await client.send(type="speak.unpause", utterance_id=uid)
        unpaused = await client.until("utterance.unpaused", uid)
        assert fenced(client, stream, paused, unpaused) == [], f"a packet of {uid} followed the fence"
        heard = paused["played_ms"]
        assert paused["spoken_text"] + paused["unspoken_text"] == text
        assert paused["position_source"] == "server" and heard <= audio_ms(client, stream, 2, rate)
    await read_until(client, lambda: bool(client.got.of_type("utterance.done", uid)))
    return pauses


async def run_session(url: str, engine: RecordingEngine, seed: int) -> int:
    rng = random.Random(seed)
    rate = (24_000, 16_000)[seed % 2]  # the resampler's state must carry over the pause too
    pauses = 0
    async with connect(url) as ws:
        client = Client(ws)
        output = {"encoding": "pcm_s16le", "sample_rate": rate, "packet_ms": 20}
        await client.send(type="session.start", pacing="realtime", output=output, language="English")
        await client.until("session.started")
        for n, uid in enumerate(("whole", "p1", "p2")):
            text = TEXTS[(seed + n) % len(TEXTS)]
            if uid == "whole":  # the reference itself, checked once without a pause
                await client.send(type="speak.append", utterance_id=uid, text=text)
                await client.send(type="speak.end", utterance_id=uid)
                await client.until("utterance.done", uid, wait_s=20)
            else:
                pauses += await paused_at_random(client, uid, text, rng, rate)
            packets = client.got.packets_of(client.got.stream_of(uid))
            headers = [h for h, _ in packets]
            assert [h.seq for h in headers] == list(range(len(headers)))  # no gap, no repeat
            assert all(
                a.sample_offset + len(p) // 2 == b.sample_offset
                for (a, p), b in zip(packets[:-1], headers[1:], strict=True)
            )
            expected = engine.expected_payload(f"{session_id(client)}/{uid}", "pcm_s16le", rate)
            assert received(client, uid) == expected  # sample for sample
            done = client.got.of_type("utterance.done", uid)[0]
            assert done["packets"] == len(packets)
    return pauses


async def test_pauses_at_random_points_continue_sample_for_sample(gateway_factory: GatewayFactory) -> None:
    engine = RecordingEngine(espeak.EspeakEngine())
    gateway = gateway_factory(engine)
    pauses = await asyncio.gather(*(run_session(gateway.ws, engine, seed) for seed in range(6)))
    assert sum(pauses) >= 8


async def test_a_pause_that_is_not_undone_becomes_an_interruption(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(espeak.EspeakEngine())
    async with connect(gateway.ws) as ws:
        client = Client(ws)
        await client.send(type="session.start", pacing="realtime", pause_timeout_ms=700, language="English")
        await client.send(type="speak.append", utterance_id="u1", text=TEXTS[1])
        await client.send(type="speak.end", utterance_id="u1")
        stream = (await client.until("utterance.started", "u1"))["stream"]
        await read_until(client, lambda: audio_ms(client, stream, 2, 24_000) >= 900)
        await client.send(type="speak.pause", utterance_id="u1", played_ms=800)
        paused = await client.until("utterance.paused", "u1")
        at = time.monotonic()
        interrupted = await client.until("utterance.interrupted", "u1", wait_s=5)
        waited = time.monotonic() - at
        await client.send(type="speak.unpause", utterance_id="u1")
        error = await client.until("error")
        await client.drain(0.3)
    assert 0.6 <= waited < 1.5
    assert interrupted == {**paused, "type": "utterance.interrupted"}
    assert paused["played_ms"] == 800 and paused["position_source"] == "client"
    assert (
        paused["last_word"] is not None
        and paused["spoken_text"] == TEXTS[1][: paused["last_word"]["char_end"]]
    )
    assert fenced(client, stream, paused, None) == []  # nothing of it after the fence, ever
    assert not client.got.of_type("utterance.done", "u1")
    assert (error["code"], error["utterance_id"]) == ("not_paused", "u1")


async def test_a_bounded_tail_holds_the_engine_back_and_loses_nothing(
    gateway_factory: GatewayFactory,
) -> None:
    engine = RecordingEngine(espeak.EspeakEngine())
    gateway = gateway_factory(engine, GatewayConfig(pause_buffer_ms=400))
    async with connect(gateway.ws) as ws:
        client = Client(ws)
        await client.send(type="session.start", pacing="realtime", language="English")
        await client.until("session.started")
        await client.send(type="speak.append", utterance_id="u1", text=TEXTS[0] + " ")
        stream = (await client.until("utterance.started", "u1"))["stream"]
        await read_until(client, lambda: audio_ms(client, stream, 2, 24_000) >= 500)
        await client.send(type="speak.pause", utterance_id="u1")
        paused = await client.until("utterance.paused", "u1")
        for more in TEXTS[1:]:  # text that the full tail keeps from the engine until the unpause
            await client.send(
                type="speak.append", utterance_id="u1", text=more + (" " if more != TEXTS[-1] else "")
            )
        await client.send(type="speak.end", utterance_id="u1")
        await asyncio.sleep(0.8)
        await client.send(type="speak.unpause", utterance_id="u1")
        unpaused = await client.until("utterance.unpaused", "u1")
        await client.until("utterance.done", "u1", wait_s=30)
    assert fenced(client, stream, paused, unpaused) == []
    assert received(client, "u1") == engine.expected_payload(f"{session_id(client)}/u1", "pcm_s16le", 24_000)
