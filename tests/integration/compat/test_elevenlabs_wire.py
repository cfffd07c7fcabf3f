"""The ElevenLabs-compatible WebSockets on the wire (real uvicorn, a plain WebSocket client): the
stream-input life cycle, output formats, character alignment, contexts, errors in ElevenLabs'
shape, and `xi-api-key` in the header or the first message."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import av
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from gateway.auth import Authenticator, KeyStore, TokenSigner, new_key
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import GatewayFactory, RunningGateway

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello there, world. "
GAP_MS = 40


def duration_ms(text: str) -> int:
    return sum(word_ms(w) + GAP_MS for w in text.split())


def url(
    g: RunningGateway, query: str = "output_format=pcm_24000", multi: bool = False, voice: str = "alice"
) -> str:
    path = "multi-stream-input" if multi else "stream-input"
    return f"ws://127.0.0.1:{g.port}/v1/text-to-speech/{voice}/{path}?{query}"


async def messages(ws: websockets.ClientConnection, until_final: bool = True) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            out.append(message)
            if until_final and message.get("isFinal"):
                return out
    except ConnectionClosed:
        return out


async def test_stream_input_speaks_then_ends_and_closes(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(json.dumps({"text": " ", "voice_settings": None, "generation_config": {}}))
        await ws.send(json.dumps({"text": TEXT, "try_trigger_generation": False}))
        await ws.send(json.dumps({"text": ""}))
        got = await messages(ws)
        with pytest.raises(ConnectionClosed):  # the server closes after isFinal
            await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1000
    audio = b"".join(base64.b64decode(m["audio"]) for m in got if m.get("audio"))
    assert len(audio) // 2 == duration_ms(TEXT) * 24
    assert got[-1] == {"isFinal": True} and all("contextId" not in m for m in got)
    chars = [c for m in got if m.get("alignment") for c in m["alignment"]["chars"]]
    assert "".join(chars) == TEXT  # every character, once, in order


async def test_alignment_times_on_both_readings(gateway: RunningGateway) -> None:
    """sync_alignment=true: times on the context's timeline; otherwise each message's count from
    the end of the previous message's last character."""
    starts: dict[bool, list[int]] = {}
    for sync in (True, False):
        async with websockets.connect(
            url(gateway, f"output_format=pcm_16000&sync_alignment={str(sync).lower()}")
        ) as ws:
            await ws.send(json.dumps({"text": TEXT}))
            await ws.send(json.dumps({"text": ""}))
            got = await messages(ws)
        absolute, base = [], 0
        for m in got:
            block = m.get("alignment")
            if not block:
                continue
            offset = 0 if sync else base
            absolute += [offset + t for t in block["charStartTimesMs"]]
            base = offset + block["charStartTimesMs"][-1] + block["charDurationsMs"][-1]
            assert block == m["normalizedAlignment"]
        starts[sync] = absolute
    assert starts[True] == starts[False]
    # each word's first character starts where the engine started the word
    word_starts = [starts[True][TEXT.index(w)] for w in TEXT.split()]
    assert word_starts == [0, word_ms("Hello") + GAP_MS, word_ms("Hello") + word_ms("there,") + 2 * GAP_MS]


@pytest.mark.parametrize(
    ("fmt", "bytes_per_ms"),
    [("pcm_16000", 32), ("pcm_44100", 88.2), ("ulaw_8000", 8), ("alaw_8000", 8)],
)
async def test_raw_output_formats(gateway: RunningGateway, fmt: str, bytes_per_ms: float) -> None:
    async with websockets.connect(url(gateway, f"output_format={fmt}")) as ws:
        await ws.send(json.dumps({"text": TEXT, "flush": True}))
        await ws.send(json.dumps({"text": ""}))
        got = await messages(ws)
    audio = b"".join(base64.b64decode(m["audio"]) for m in got if m.get("audio"))
    assert abs(len(audio) - duration_ms(TEXT) * bytes_per_ms) <= bytes_per_ms * 2


@pytest.mark.parametrize("fmt", ["mp3_44100_128", "mp3_22050_32", "opus_48000_64"])
async def test_compressed_output_formats_decode(gateway: RunningGateway, fmt: str) -> None:
    async with websockets.connect(url(gateway, f"output_format={fmt}")) as ws:
        await ws.send(json.dumps({"text": TEXT}))
        await ws.send(json.dumps({"text": ""}))
        got = await messages(ws)
    data = b"".join(base64.b64decode(m["audio"]) for m in got if m.get("audio"))
    assert sum(1 for m in got if m.get("audio")) > 1  # streamed in pieces
    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(audio=0))
    ms = sum(f.samples for f in frames) * 1000 / frames[0].sample_rate
    assert duration_ms(TEXT) - 2 <= ms <= duration_ms(TEXT) + 100  # the codec's delay and padding


async def test_multi_stream_contexts_flush_close_and_keep_alive(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway, multi=True)) as ws:
        for cid in ("a", "b"):
            await ws.send(json.dumps({"text": " ", "context_id": cid}))
        await ws.send(json.dumps({"text": "", "context_id": "a"}))  # a keep-alive: nothing happens
        await ws.send(json.dumps({"text": "First one. ", "context_id": "a", "flush": True}))
        await ws.send(json.dumps({"text": "Second one. ", "context_id": "b"}))
        await ws.send(json.dumps({"context_id": "b", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        await ws.send(json.dumps({"context_id": "b", "close_context": True}))
        got: list[dict[str, Any]] = []
        while sum(1 for m in got if m.get("isFinal")) < 2:
            got += await messages(ws)
        await ws.send(json.dumps({"close_socket": True}))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
    for cid, text in (("a", "First one. "), ("b", "Second one. ")):
        audio = b"".join(
            base64.b64decode(m["audio"]) for m in got if m.get("contextId") == cid and m.get("audio")
        )
        assert len(audio) // 2 == duration_ms(text) * 24  # both finished: everything was flushed
        assert {"isFinal": True, "contextId": cid} in got


async def test_close_context_with_unflushed_text_stops_it(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine(step_s=0.02)
    g = gateway_factory(engine)
    async with websockets.connect(url(g, multi=True)) as ws:
        await ws.send(json.dumps({"text": " ".join(f"word{i}." for i in range(40)) + " ", "context_id": "x"}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert first.get("audio") and first["contextId"] == "x"
        await ws.send(json.dumps({"context_id": "x", "close_context": True}))
        got = await messages(ws)
    assert got[-1] == {"isFinal": True, "contextId": "x"}
    assert engine.streams[0].cancelled and engine.words_spoken < 40


async def test_errors_have_elevenlabs_shape(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway, "output_format=wav_99")) as ws:
        error = json.loads(await asyncio.wait_for(ws.recv(), 5))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
    assert (
        error["error"] == "invalid_output_format" and "wav_99" in error["message"] and ws.close_code == 1008
    )
    async with websockets.connect(url(gateway, multi=True, voice="nobody")) as ws:
        await ws.send("not json")
        assert json.loads(await asyncio.wait_for(ws.recv(), 5))["error"] == "invalid_message"
        await ws.send(json.dumps({"text": "Hi. ", "context_id": "c", "flush": True}))
        got = await messages(ws)
    assert got[0]["error"] == "unknown_voice" and got[0]["contextId"] == "c"
    assert got[-1] == {"isFinal": True, "contextId": "c"}


async def test_xi_api_key_in_header_or_first_message(gateway_factory: GatewayFactory) -> None:
    key, stored = new_key("agent", iterations=1000)
    g = gateway_factory(FakeEngine(), auth=Authenticator(KeyStore([stored]), TokenSigner()))
    async with websockets.connect(url(g), additional_headers={"xi-api-key": key}) as ws:
        await ws.send(json.dumps({"text": "Hi. "}))
        await ws.send(json.dumps({"text": ""}))
        assert (await messages(ws))[-1] == {"isFinal": True}
    async with websockets.connect(url(g)) as ws:
        await ws.send(json.dumps({"text": " ", "xi_api_key": key}))
        await ws.send(json.dumps({"text": "Hi. "}))
        await ws.send(json.dumps({"text": ""}))
        assert (await messages(ws))[-1] == {"isFinal": True}
    async with websockets.connect(url(g)) as ws:
        await ws.send(json.dumps({"text": " ", "xi-api-key": key + "x"}))
        error = json.loads(await asyncio.wait_for(ws.recv(), 5))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
    assert error["error"] == "unauthorized" and ws.close_code == 1008
    async with websockets.connect(url(g, multi=True)) as ws:  # no key at all: refused the same way
        await ws.send(json.dumps({"text": "Hi. ", "context_id": "a"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 5))["error"] == "unauthorized"
