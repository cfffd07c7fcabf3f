"""The Cartesia-compatible `/tts/websocket` on the wire (real uvicorn, a plain WebSocket client):
continued contexts, raw output formats, word timestamps, flush / flush_done, cancel (answered with
nothing, the other context unharmed), errors in Cartesia's shape, and its credentials."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from gateway.auth import Authenticator, KeyStore, TokenSigner, new_key
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import GatewayFactory, RunningGateway

pytestmark = pytest.mark.timeout(60)

GAP_MS = 40


def duration_ms(text: str) -> int:
    return sum(word_ms(w) + GAP_MS for w in text.split())


def request(context_id: str, transcript: str, more: bool, **extra: Any) -> str:
    body = {
        "context_id": context_id,
        "model_id": "sonic-3",
        "transcript": transcript,
        "voice": {"mode": "id", "id": "bob"},
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
        "continue": more,
        "add_timestamps": True,
        **extra,
    }
    return json.dumps(body)


def url(g: RunningGateway, query: str = "cartesia_version=2026-08-14") -> str:
    return f"ws://127.0.0.1:{g.port}/tts/websocket?{query}"


async def until_done(ws: websockets.ClientConnection, contexts: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    left = set(contexts)
    while left:
        message = json.loads(await asyncio.wait_for(ws.recv(), 10))
        out.append(message)
        if message["type"] in ("done", "error"):
            left.discard(message.get("context_id"))
    return out


def audio_of(messages: list[dict[str, Any]], context_id: str) -> bytes:
    return b"".join(
        base64.b64decode(m["data"])
        for m in messages
        if m["type"] == "chunk" and m["context_id"] == context_id
    )


async def test_a_continued_context_with_word_timestamps(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway), additional_headers={"Cartesia-Version": "2024-06-10"}) as ws:
        await ws.send(request("turn-1", "Hello there. ", True))
        await ws.send(request("turn-1", "How are you?", False))
        got = await until_done(ws, {"turn-1"})
    text = "Hello there. How are you?"
    assert len(audio_of(got, "turn-1")) // 2 == duration_ms(text) * 24
    stamps = [m["word_timestamps"] for m in got if m["type"] == "timestamps"]
    words = [w for s in stamps for w in s["words"]]
    starts = [t for s in stamps for t in s["start"]]
    ends = [t for s in stamps for t in s["end"]]
    assert words == text.split()
    at, expected = 0, []
    for w in words:
        expected += [at / 1000, (at + word_ms(w)) / 1000]
        at += word_ms(w) + GAP_MS
    assert [t for pair in zip(starts, ends, strict=True) for t in pair] == pytest.approx(expected, abs=0.002)
    assert got[-1] == {"type": "done", "context_id": "turn-1", "done": True, "status_code": 206}


@pytest.mark.parametrize(
    ("encoding", "rate", "bytes_per_sample"),
    [("pcm_f32le", 16000, 4), ("pcm_mulaw", 8000, 1), ("pcm_alaw", 8000, 1), ("pcm_s16le", 44100, 2)],
)
async def test_raw_output_formats(
    gateway: RunningGateway, encoding: str, rate: int, bytes_per_sample: int
) -> None:
    fmt = {"container": "raw", "encoding": encoding, "sample_rate": rate}
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(request("c", "One two three.", False, output_format=fmt))
        got = await until_done(ws, {"c"})
    samples = len(audio_of(got, "c")) / bytes_per_sample
    assert abs(samples - duration_ms("One two three.") * rate / 1000) <= rate / 500


async def test_flush_done_follows_the_flushed_audio(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(request("f", "First part.", True, flush=True))
        await ws.send(request("f", " Second part.", False))
        got = await until_done(ws, {"f"})
    kinds = [m["type"] for m in got]
    flush = kinds.index("flush_done")
    assert got[flush]["flush_id"] == 1 and got[flush]["context_id"] == "f"
    before = b"".join(base64.b64decode(m["data"]) for m in got[:flush] if m["type"] == "chunk")
    assert len(before) // 2 >= (word_ms("First") + GAP_MS + word_ms("part.")) * 24  # its audio went first
    assert {m["flush_id"] for m in got[flush:] if m["type"] == "chunk"} == {2}


async def test_cancel_stops_one_context_and_answers_nothing(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine(step_s=0.01)
    g = gateway_factory(engine)
    async with websockets.connect(url(g)) as ws:
        await ws.send(request("long", " ".join(f"word{i}." for i in range(40)), False))
        await ws.send(request("short", "Just this.", False))
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        await ws.send(json.dumps({"context_id": "long", "cancel": True}))
        got = [first, *await until_done(ws, {"short"})]
        with pytest.raises(TimeoutError):  # nothing more comes: no done for the cancelled context
            while True:
                late = json.loads(await asyncio.wait_for(ws.recv(), 0.5))
                assert late.get("context_id") != "long" or late["type"] == "chunk"
    assert len(audio_of(got, "short")) // 2 == duration_ms("Just this.") * 24
    assert not [m for m in got if m["context_id"] == "long" and m["type"] == "done"]
    assert engine.streams[0].cancelled and not engine.streams[1].cancelled  # long, then short


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"transcript": "x"}, "invalid_request"),  # no context_id
        ({"context_id": "e", "transcript": 5}, "invalid_transcript"),
        (
            {"context_id": "e", "transcript": "x", "output_format": {"container": "mp3"}},
            "unsupported_output_format",
        ),
        (
            {
                "context_id": "e",
                "transcript": "x",
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 12345},
            },
            "unsupported_output_format",
        ),
        (
            {"context_id": "e", "transcript": "x", "voice": {"mode": "embedding", "embedding": [0.1]}},
            "unsupported_voice_mode",
        ),
        ({"context_id": "e", "transcript": "Hi.", "voice": {"mode": "id", "id": "nobody"}}, "unknown_voice"),
    ],
)
async def test_errors_have_cartesia_shape(gateway: RunningGateway, body: dict[str, Any], code: str) -> None:
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(json.dumps(body))
        error = json.loads(await asyncio.wait_for(ws.recv(), 5))
    assert error["type"] == "error" and error["error_code"] == code and error["done"] is True
    assert error["title"] and error["message"] and error["error"] == error["message"]
    assert error["status_code"] == 400 and error["context_id"] == body.get("context_id")


async def test_credentials_as_cartesia_sends_them(gateway_factory: GatewayFactory) -> None:
    key, stored = new_key("agent", iterations=1000)
    g = gateway_factory(FakeEngine(), auth=Authenticator(KeyStore([stored]), TokenSigner()))
    for options in (
        {"additional_headers": {"X-API-Key": key}},
        {"additional_headers": {"Authorization": f"Bearer {key}"}},
        {"query": f"api_key={key}&cartesia_version=2025-04-16"},
    ):
        query = str(options.pop("query", "cartesia_version=2026-08-14"))
        async with websockets.connect(url(g, query), **options) as ws:  # type: ignore[arg-type]
            await ws.send(request("a", "Hi.", False))
            assert (await until_done(ws, {"a"}))[-1]["type"] == "done"
    async with websockets.connect(url(g), additional_headers={"X-API-Key": key + "x"}) as ws:
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1008
