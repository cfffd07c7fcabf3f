"""The vLLM-Omni-compatible `/v1/audio/speech/stream` on the wire (real uvicorn): the session
life cycle, utterances in order while the next is already being made, word timestamps in both of
vLLM-Omni's forms, whole files with `stream_audio: false`, errors in vLLM-Omni's shape, closing as
barge-in, and Cadence's own vLLM-Omni engine client (engine.vllm_omni) speaking through it."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import websockets

from engine.api import SynthesisRequest, TextSegment
from engine.vllm_omni.engine import VllmOmniConfig, VllmOmniEngine
from gateway.auth import Authenticator, KeyStore, TokenSigner, new_key
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import GatewayFactory, RunningGateway

pytestmark = pytest.mark.timeout(60)

GAP_MS = 40
CONFIG = {"type": "session.config", "voice": "alice", "response_format": "pcm", "stream_audio": True}


def duration_ms(text: str) -> int:
    return sum(word_ms(w) + GAP_MS for w in text.split())


def url(g: RunningGateway) -> str:
    return f"ws://127.0.0.1:{g.port}/v1/audio/speech/stream"


async def session(ws: websockets.ClientConnection, sessions_done: int) -> list[dict[str, Any] | bytes]:
    out: list[dict[str, Any] | bytes] = []
    while sessions_done:
        frame = await asyncio.wait_for(ws.recv(), 10)
        if isinstance(frame, bytes):
            out.append(frame)
            continue
        message = json.loads(frame)
        out.append(message)
        if message["type"] == "session.done":
            sessions_done -= 1
    return out


async def test_utterances_in_order_and_an_empty_input_done(gateway: RunningGateway) -> None:
    first, second = "Hello there. How are you?", "Fine, thanks."
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(json.dumps(CONFIG))
        for text in (first, second):
            for word in text.split(" "):
                await ws.send(json.dumps({"type": "input.text", "text": word + " "}))
            await ws.send(json.dumps({"type": "input.done"}))
        await ws.send(json.dumps({"type": "input.done"}))  # nothing since: a keep-alive
        got = await session(ws, 3)
    events = [m if isinstance(m, dict) else {"type": "pcm", "bytes": len(m)} for m in got]
    kinds = [e["type"] for e in events]
    assert [k for k in kinds if k != "pcm"] == ["audio.start", "audio.done", "session.done"] * 2 + [
        "session.done"
    ]
    for index, text in enumerate((first, second)):
        start = kinds.index("audio.start", 3 * index if index == 0 else kinds.index("session.done") + 1)
        done = kinds.index("audio.done", start)
        pcm = sum(e["bytes"] for e in events[start:done] if e["type"] == "pcm")
        assert pcm // 2 == duration_ms(text) * 24 and events[done]["total_bytes"] == pcm
        assert events[start]["sample_rate"] == 24000 and events[start]["utterance_index"] == index
    assert events[-1] == {"type": "session.done", "utterance_index": 2, "total_sentences": 0}


@pytest.mark.parametrize("form", ["word_timestamps", "timestamp_type"])
async def test_word_timestamps_in_both_forms(gateway: RunningGateway, form: str) -> None:
    text = "Hello there world."
    extra = {"word_timestamps": True} if form == "word_timestamps" else {"timestamp_type": "word"}
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(json.dumps({**CONFIG, **extra}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        got = [m for m in await session(ws, 1)]
    expected, at = [], 0
    for w in text.split():
        expected.append({"word": w, "start_ms": at, "end_ms": at + word_ms(w)})
        at += word_ms(w) + GAP_MS
    messages = [m for m in got if isinstance(m, dict)]
    if form == "word_timestamps":
        assert not [m for m in got if isinstance(m, bytes)]  # audio comes as audio.chunk frames
        chunks = [m for m in messages if m["type"] == "audio.chunk"]
        audio = b"".join(base64.b64decode(c["audio_b64"]) for c in chunks)
        assert len(audio) // 2 == duration_ms(text) * 24
        assert chunks[-1]["audio_b64"] == "" and chunks[-1]["timestamps"] == expected
    else:
        info = next(m for m in messages if m["type"] == "audio.done")["timestamp_info"]["word_alignment"]
        assert info["words"] == [e["word"] for e in expected]
        assert info["word_start_times_seconds"] == pytest.approx([e["start_ms"] / 1000 for e in expected])
        assert info["word_end_times_seconds"] == pytest.approx([e["end_ms"] / 1000 for e in expected])


async def test_whole_files_without_stream_audio(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "bob", "response_format": "wav"}))
        await ws.send(json.dumps({"type": "input.text", "text": "One file."}))
        await ws.send(json.dumps({"type": "input.done"}))
        got = await session(ws, 1)
    [wav] = [m for m in got if isinstance(m, bytes)]
    audio, rate = sf.read(io.BytesIO(wav), dtype="float32")
    assert rate == 24000 and len(audio) == duration_ms("One file.") * 24


async def test_errors_have_vllm_omni_shape(gateway: RunningGateway) -> None:
    async with websockets.connect(url(gateway)) as ws:
        await ws.send(json.dumps({"type": "input.text", "text": "too early"}))
        assert json.loads(await ws.recv()) == {
            "type": "error",
            "message": "Expected session.config, got: input.text",
        }
        await ws.send(json.dumps({**CONFIG, "response_format": "wav"}))
        assert "requires response_format='pcm'" in json.loads(await ws.recv())["message"]
        await ws.send(json.dumps({**CONFIG, "speed": 1.5}))
        assert "speed" in json.loads(await ws.recv())["message"]
        await ws.send(json.dumps({**CONFIG, "voice": "nobody"}))
        await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
        await ws.send(json.dumps({"type": "input.done"}))
        got = [m for m in await session(ws, 1) if isinstance(m, dict)]
        await ws.send("{nope")
        assert json.loads(await ws.recv()) == {"type": "error", "message": "Invalid JSON message"}
    assert [m["type"] for m in got] == ["audio.start", "error", "audio.done", "session.done"]
    assert (
        got[1]["message"].startswith("Generation failed for utterance 0, sentence 0:")
        and got[2]["error"] is True
    )


async def test_closing_the_socket_cancels_the_utterance(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine(step_s=0.02)
    g = gateway_factory(engine)
    async with websockets.connect(url(g)) as ws:
        await ws.send(json.dumps(CONFIG))
        await ws.send(json.dumps({"type": "input.text", "text": " ".join(f"word{i}." for i in range(40))}))
        await ws.send(json.dumps({"type": "input.done"}))
        while not isinstance(await asyncio.wait_for(ws.recv(), 10), bytes):
            pass
    for _ in range(200):
        if engine.streams[0].cancelled:
            break
        await asyncio.sleep(0.02)
    assert engine.streams[0].cancelled and engine.words_spoken < 40


async def test_api_key_header_as_baseten_sends_it(gateway_factory: GatewayFactory) -> None:
    key, stored = new_key("agent", iterations=1000)
    g = gateway_factory(FakeEngine(), auth=Authenticator(KeyStore([stored]), TokenSigner()))
    async with websockets.connect(url(g), additional_headers={"Authorization": f"Api-Key {key}"}) as ws:
        await ws.send(json.dumps(CONFIG))
        await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
        await ws.send(json.dumps({"type": "input.done"}))
        assert (await session(ws, 1))[-1]["type"] == "session.done"  # type: ignore[index]


async def test_cadences_vllm_omni_engine_speaks_through_it(gateway: RunningGateway) -> None:
    """engine.vllm_omni (the client of real vLLM-Omni servers) with this gateway as its upstream."""
    engine = VllmOmniEngine(
        VllmOmniConfig(upstream=gateway.http, voices=("alice", "bob"), health_interval_s=60)
    )
    await engine.start()
    try:
        assert engine.load().ready  # /health answered
        stream = engine.open(SynthesisRequest(request_id="r1", voice="bob", language="English"))
        texts = ["Hello there. ", "This is Cadence."]
        offset = 0
        for text in texts:
            stream.push(TextSegment(text=text, char_start=offset, language="English"))
            offset += len(text)
        stream.close_text()
        samples = np.concatenate([c.samples for c in [chunk async for chunk in stream]])
    finally:
        await engine.stop()
    assert len(samples) == sum(duration_ms(t) for t in texts) * 24
