"""The WebSocket protocol end to end over real uvicorn on loopback, with the FakeEngine (and the
eSpeak engine where it is available)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

from gateway.bargein import END_TOLERANCE_MS
from gateway.config import GatewayConfig
from gateway.packets import decode_payload
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import GatewayFactory, RunningGateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)

TEXT = "Sure, I can help you with that. It will only take a moment, I promise."


async def speak(client: Client, uid: str, text: str) -> None:
    await client.send(type="speak.append", utterance_id=uid, text=text)
    await client.send(type="speak.end", utterance_id=uid)


async def test_a_whole_utterance(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", TEXT)
        done = await c.until("utterance.done", "u1")
    got = c.got
    assert got.messages[0]["type"] == "session.started"
    stream = got.stream_of("u1")
    packets = got.packets_of(stream)
    assert [h.seq for h, _ in packets] == list(range(len(packets)))
    assert [h.sample_offset for h, _ in packets] == [i * 480 for i in range(len(packets))]
    assert packets[-1][0].last and not any(h.last for h, _ in packets[:-1])
    assert done["packets"] == len(packets)
    samples = sum(len(p) // 2 for _, p in packets)
    assert done["duration_ms"] == round(samples / 24)
    words = got.words_of("u1")
    assert [w["text"] for w in words] == TEXT.split()
    assert [w["index"] for w in words] == list(range(len(words)))
    for w in words:
        assert TEXT[w["char_start"] : w["char_end"]] == w["text"]
    assert words[0]["end_ms"] == word_ms("Sure,")
    # utterance.started comes before the first packet; each word before the audio it describes
    first_packet = next(i for i, x in enumerate(got.order) if not isinstance(x, dict))
    started = next(
        i for i, x in enumerate(got.order) if isinstance(x, dict) and x["type"] == "utterance.started"
    )
    assert started < first_packet
    for w in words:
        sent_ms_before = 0
        for x in got.order:
            if isinstance(x, dict) and x["type"] == "words" and w in x["words"]:
                break
            if not isinstance(x, dict):
                sent_ms_before = (x.sample_offset + 480) * 1000 // 24000
        assert sent_ms_before <= w["start_ms"] + 20


async def test_audio_is_the_engines_tones(gateway: RunningGateway) -> None:
    engine = gateway.engine
    assert isinstance(engine, FakeEngine)
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", "hello")
        await c.until("utterance.done", "u1")
    audio = np.concatenate([decode_payload(p, "pcm_s16le") for _, p in c.got.packets])
    expected = engine.tone("hello")
    assert np.allclose(audio[: len(expected)], expected, atol=2 / 32768)


async def test_token_by_token_appends(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        for i in range(0, len(TEXT), 3):
            await c.send(type="speak.append", utterance_id="u1", text=TEXT[i : i + 3])
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
    words = c.got.words_of("u1")
    assert [w["text"] for w in words] == TEXT.split()
    assert all(TEXT[w["char_start"] : w["char_end"]] == w["text"] for w in words)
    starts = [w["start_ms"] for w in words]
    assert starts == sorted(starts)


async def test_first_audio_before_the_text_ends(gateway: RunningGateway) -> None:
    """A complete sentence is synthesised while the rest of the text is still coming."""
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="First sentence here. And then")
        header = None
        while header is None:
            item = await c.next()
            if not isinstance(item, dict):
                header = item
        assert header.seq == 0
        await speak(c, "u1", "")
        await c.until("utterance.done", "u1")


async def test_two_concurrent_utterances(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="a", text="one two three four five six")
        await c.send(type="speak.append", utterance_id="b", text="seven eight nine ten eleven twelve")
        await c.send(type="speak.end", utterance_id="a")
        await c.send(type="speak.end", utterance_id="b")
        await c.until("utterance.done", "a")
        if not c.got.of_type("utterance.done", "b"):
            await c.until("utterance.done", "b")
    sa, sb = c.got.stream_of("a"), c.got.stream_of("b")
    assert sa != sb
    for uid, stream in (("a", sa), ("b", sb)):
        packets = c.got.packets_of(stream)
        assert [h.seq for h, _ in packets] == list(range(len(packets)))
        assert c.got.of_type("utterance.done", uid)[0]["packets"] == len(packets)
    order = [h.stream for h, _ in c.got.packets]
    assert order.index(sb) < len(order) - 1 - order[::-1].index(sa), "the two streams interleave"
    assert [w["text"] for w in c.got.words_of("b")] == "seven eight nine ten eleven twelve".split()


@pytest.mark.parametrize("seed", range(4))
async def test_barge_in_at_a_random_position(gateway_factory: GatewayFactory, seed: int) -> None:
    rng = random.Random(seed)
    g = gateway_factory(FakeEngine(step_s=0.004))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", TEXT)
        await c.until("utterance.started", "u1")
        stream = c.got.stream_of("u1")
        wait_packets = rng.randint(5, 60)
        while len(c.got.packets_of(stream)) < wait_packets:
            await c.next()
        received_ms = len(c.got.packets_of(stream)) * 20
        played = rng.randint(0, received_ms)
        await c.send(type="speak.cancel", utterance_id="u1", played_ms=played)
        fence = await c.until("utterance.interrupted", "u1")
        packets_at_fence = len(c.got.packets_of(stream))
        await c.send(type="speak.append", utterance_id="probe", text="ok")
        await c.send(type="speak.end", utterance_id="probe")
        await c.until("utterance.done", "probe")
    assert len(c.got.packets_of(stream)) == packets_at_fence, "no packet of the stream after the fence"
    assert not c.got.of_type("utterance.done", "u1")
    assert fence["position_source"] == "client"
    assert fence["played_ms"] == min(played, fence["played_ms"]) and fence["played_ms"] <= played
    words = c.got.words_of("u1")
    heard = [w for w in words if w["end_ms"] <= fence["played_ms"] + END_TOLERANCE_MS]
    assert fence["last_word"] == (heard[-1] if heard else None)
    partial = [w for w in words if w["start_ms"] <= fence["played_ms"] < w["end_ms"] and w not in heard]
    assert fence["partial_word"] == (partial[0] if partial else None)
    assert fence["spoken_text"] + fence["unspoken_text"] == TEXT
    if fence["last_word"]:
        assert fence["spoken_text"] == TEXT[: fence["last_word"]["char_end"]]


async def test_barge_in_while_the_engine_is_stalled(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine(stall_after_words=3)
    g = gateway_factory(engine)
    async with connect(g.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", TEXT)
        await c.until("utterance.started", "u1")
        while len(c.got.words_of("u1")) < 3:
            await c.next()
        await c.drain(0.2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await c.send(type="speak.cancel", utterance_id="u1")
        fence = await c.until("utterance.interrupted", "u1", wait_s=2)
        assert loop.time() - t0 < 0.5
        assert fence["position_source"] == "server"
    await asyncio.sleep(0.05)
    assert engine.streams[0].cancelled and not engine.active


async def test_resume_after_barge_in(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", TEXT)
        await c.until("utterance.done", "u1")
        words = c.got.words_of("u1")
        played = words[3]["end_ms"] + 50  # inside word 4
        await c.send(type="speak.cancel", utterance_id="u1", played_ms=played)
        fence = await c.until("utterance.interrupted", "u1")
        assert fence["last_word"]["text"] == "help"
        await c.send(type="speak.resume", utterance_id="u2", from_utterance="u1")
        started = await c.until("utterance.started", "u2")
        await c.until("utterance.done", "u2")
    offset = started["text_offset"]
    rest = TEXT[offset:]
    assert rest.startswith("you with that.")
    assert [w["text"] for w in c.got.words_of("u2")] == rest.split()
    assert all(rest[w["char_start"] : w["char_end"]] == w["text"] for w in c.got.words_of("u2"))


async def test_playback_report_position(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(step_s=0.003))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", TEXT)
        stream = (await c.until("utterance.started", "u1"))["stream"]
        while len(c.got.packets_of(stream)) < 40:
            await c.next()
        await c.send(type="playback.report", utterance_id="u1", played_ms=300)
        await c.send(type="speak.cancel", utterance_id="u1")
        fence = await c.until("utterance.interrupted", "u1")
    assert fence["position_source"] == "report"
    assert 300 <= fence["played_ms"] <= 300 + 500


async def test_realtime_pacing_keeps_a_bounded_lead(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(), GatewayConfig(realtime_lead_ms=100, pacing_tick_ms=40))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", pacing="realtime")
        await speak(c, "u1", "one two three four")
        loop = asyncio.get_running_loop()
        arrivals: list[tuple[float, int]] = []
        while True:
            item = await c.next()
            if not isinstance(item, dict):
                arrivals.append((loop.time(), item.sample_offset))
                if item.last:
                    break
    t0 = arrivals[0][0]
    for at, offset in arrivals:
        audio_s = offset / 24000
        assert at - t0 >= audio_s - 0.1 - 0.03, "ran ahead of real time by more than the lead"
    total_s = arrivals[-1][1] / 24000
    assert arrivals[-1][0] - t0 >= total_s - 0.15


async def test_session_end_finishes_then_closes(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="one two three")
        await c.send(type="session.end")
        await c.until("session.ended")
        with pytest.raises(ConnectionClosed):
            await c.next(2)
        assert ws.close_code == 1000
    assert c.got.of_type("utterance.done", "u1")


@pytest.mark.parametrize(
    ("encoding", "rate", "width"),
    [("mulaw", 8000, 1), ("alaw", 8000, 1), ("pcm_f32le", 48000, 4), ("pcm_s16le", 16000, 2)],
)
async def test_negotiated_output_formats(
    gateway: RunningGateway, encoding: str, rate: int, width: int
) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", output={"encoding": encoding, "sample_rate": rate})
        started = await c.until("session.started")
        assert started["output"]["samples_per_packet"] == rate // 50
        await speak(c, "u1", "hello world")
        done = await c.until("utterance.done", "u1")
    packets = c.got.packets
    assert all(len(p) == rate // 50 * width for _, p in packets[:-1])
    audio = np.concatenate([decode_payload(p, encoding) for _, p in packets])  # type: ignore[arg-type]
    assert abs(len(audio) / rate * 1000 - done["duration_ms"]) <= 1
    assert 0.2 < np.max(np.abs(audio)) < 0.4


async def test_health_ready_metrics_and_index(gateway: RunningGateway) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=gateway.http) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True
        async with connect(gateway.ws) as ws:
            c = Client(ws)
            await speak(c, "u1", "hello")
            await c.until("utterance.done", "u1")
            await c.send(type="nonsense")
            await c.until("error")
        metrics = (await http.get("/metrics")).text
        assert "cadence_ttfa_seconds_count" in metrics
        assert 'cadence_errors_total{code="unknown_type"} 1.0' in metrics
        assert "cadence_packets_sent_total" in metrics
        assert (await http.get("/")).status_code == 200


async def test_shutdown_closes_sessions_with_1001(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(stall_after_words=1), GatewayConfig(drain_timeout_s=0.2))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", "one two three")
        await c.until("utterance.started", "u1")
        g.stop()
        with pytest.raises(ConnectionClosed):
            while True:
                await c.next(5)
        assert ws.close_code == 1001


def espeak_engine() -> object:
    try:
        from engine.espeak.engine import EspeakEngine

        return EspeakEngine()
    except Exception as exc:  # missing library or module
        pytest.skip(f"eSpeak engine unavailable: {exc}")


async def test_espeak_whole_utterance_and_barge_in(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(espeak_engine())  # type: ignore[arg-type]
    async with connect(g.ws) as ws:
        c = Client(ws)
        await speak(c, "u1", TEXT)
        done = await c.until("utterance.done", "u1", wait_s=30)
        assert done["duration_ms"] > 1000
        words = c.got.words_of("u1")
        assert len(words) >= 10
        for w in words:
            assert 0 <= w["char_start"] < w["char_end"] <= len(TEXT)
        middle = words[len(words) // 2]
        await c.send(type="speak.cancel", utterance_id="u1", played_ms=middle["end_ms"])
        fence = await c.until("utterance.interrupted", "u1")
        assert fence["last_word"]["index"] >= middle["index"]
        assert fence["spoken_text"] + fence["unspoken_text"] == TEXT
