"""Dialect behaviour a client of the upstream API relies on, on the wire (real uvicorn, a plain
WebSocket or HTTP client): the end of an empty ElevenLabs stream, ElevenLabs' context keep-alive,
vLLM-Omni's session.close after input.done, and Opus at output rates Opus does not have."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import av
import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed

from gateway.compat.cartesia import CartesiaSocket, _Context
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)

GAP_MS = 40


def duration_ms(text: str) -> int:
    return sum(word_ms(w) + GAP_MS for w in text.split())


@pytest.fixture
def gateway() -> Iterator[RunningGateway]:
    with run_gateway(FakeEngine()) as g:
        yield g


async def frames(ws: websockets.ClientConnection, wait_s: float = 5) -> list[Any]:
    """Everything the server sends until it closes (JSON decoded, binary as bytes)."""
    out: list[Any] = []
    with pytest.raises(ConnectionClosed):
        while True:
            frame = await asyncio.wait_for(ws.recv(), wait_s)
            out.append(frame if isinstance(frame, bytes) else json.loads(frame))
    return out


async def test_elevenlabs_stream_input_ended_with_no_text_finishes(gateway: RunningGateway) -> None:
    """ElevenLabs' `{"text": ""}` ends the stream and the socket whatever was sent before it."""
    url = f"ws://127.0.0.1:{gateway.port}/v1/text-to-speech/alice/stream-input?output_format=pcm_24000"
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": ""}))
        got = await frames(ws)
    assert got == [{"isFinal": True}] and ws.close_code == 1000


async def test_elevenlabs_context_keep_alive_keeps_the_context_open() -> None:
    """`{"text": "", "context_id"}` resets the context's inactivity timer (Pipecat sends it while
    its LLM is busy): the context still takes text after the gateway's text timeout has passed."""
    with run_gateway(FakeEngine(), GatewayConfig(text_timeout_s=1.0)) as g:
        url = f"ws://127.0.0.1:{g.port}/v1/text-to-speech/alice/multi-stream-input?output_format=pcm_24000"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "a"}))
            await ws.send(json.dumps({"text": "Let me check. ", "context_id": "a", "flush": True}))
            got: list[dict[str, Any]] = []
            deadline = time.monotonic() + 3.0  # three text timeouts
            while time.monotonic() < deadline:
                await ws.send(json.dumps({"text": "", "context_id": "a"}))
                tick = time.monotonic() + 0.3
                with contextlib.suppress(TimeoutError):  # websockets' recv may be cancelled safely
                    while (left := tick - time.monotonic()) > 0:
                        got.append(json.loads(await asyncio.wait_for(ws.recv(), left)))
            assert not any(m.get("isFinal") for m in got)  # not ended behind the client's back
            await ws.send(json.dumps({"text": "It is done. ", "context_id": "a", "flush": True}))
            await ws.send(json.dumps({"context_id": "a", "close_context": True}))
            while not got or not got[-1].get("isFinal"):
                got.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    audio = b"".join(base64.b64decode(m["audio"]) for m in got if m.get("audio"))
    assert len(audio) // 2 == duration_ms("Let me check. It is done. ") * 24
    assert [m for m in got if m.get("isFinal")] == [{"isFinal": True, "contextId": "a"}]


async def test_vllm_omni_session_close_sends_the_ended_utterance_first(gateway: RunningGateway) -> None:
    """vLLM-Omni serves messages in turn: an utterance ended by input.done is sent whole, then
    session.close closes; text after the last input.done is not spoken."""
    async with websockets.connect(f"ws://127.0.0.1:{gateway.port}/v1/audio/speech/stream") as ws:
        await ws.send(json.dumps({"type": "session.config", "stream_audio": True, "response_format": "pcm"}))
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there. "}))
        await ws.send(json.dumps({"type": "input.done"}))
        await ws.send(json.dumps({"type": "input.text", "text": "Never said. "}))
        await ws.send(json.dumps({"type": "session.close"}))
        got = await frames(ws)
    assert ws.close_code == 1000
    events = [m["type"] for m in got if isinstance(m, dict)]
    assert events == ["audio.start", "audio.done", "session.done"]
    audio = b"".join(m for m in got if isinstance(m, bytes))
    assert len(audio) // 2 == duration_ms("Hello there. ") * 24


async def test_vllm_omni_opus_at_a_rate_opus_lacks_is_a_config_error(gateway: RunningGateway) -> None:
    """A whole-file format the config's rate cannot make is refused at session.config with
    vLLM-Omni's error shape, and the socket goes on with a config it can make."""
    async with websockets.connect(f"ws://127.0.0.1:{gateway.port}/v1/audio/speech/stream") as ws:
        await ws.send(json.dumps({"type": "session.config", "response_format": "opus", "sample_rate": 22050}))
        error = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["type"] == "error" and "opus" in error["message"] and "22050" in error["message"]
        await ws.send(json.dumps({"type": "session.config", "response_format": "opus", "sample_rate": 24000}))
        await ws.send(json.dumps({"type": "input.text", "text": "Hello there. "}))
        await ws.send(json.dumps({"type": "input.done"}))
        got: list[Any] = []
        while not (got and isinstance(got[-1], dict) and got[-1].get("type") == "session.done"):
            frame = await asyncio.wait_for(ws.recv(), 5)
            got.append(frame if isinstance(frame, bytes) else json.loads(frame))
    files = [m for m in got if isinstance(m, bytes)]
    assert len(files) == 1
    with av.open(io.BytesIO(files[0])) as container:
        assert sum(f.samples for f in container.decode(audio=0)) > 0


@pytest.mark.parametrize("rest_rate", [22050, 44100])
def test_rest_opus_at_a_rest_rate_opus_lacks(rest_rate: int) -> None:
    """OpenAI serves `response_format: opus` whatever the rest; at a REST rate Opus has no mode
    for, the file is made at 48 kHz (and says so) instead of failing with a bare 500."""
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(rest_sample_rate=rest_rate)) as g:
        response = httpx.post(
            f"{g.http}/v1/audio/speech",
            json={"model": "tts-1", "input": "Hello there.", "voice": "alice", "response_format": "opus"},
            timeout=10,
        )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/ogg" and response.headers["x-sample-rate"] == "48000"
    with av.open(io.BytesIO(response.content)) as container:
        decoded = list(container.decode(audio=0))
    ms = sum(f.samples for f in decoded) * 1000 / decoded[0].sample_rate
    assert duration_ms("Hello there.") - 2 <= ms <= duration_ms("Hello there.") + 100


@pytest.mark.parametrize("dialect", ["elevenlabs", "cartesia"])
async def test_a_context_ended_by_an_error_ends_its_engine_stream(dialect: str) -> None:
    """An append refused with text_too_long leaves the native utterance going; the dialect ends
    the context on the error, so its engine stream must end with it rather than hold a slot."""
    engine = FakeEngine()
    first: dict[str, Any]
    second: dict[str, Any]
    with run_gateway(engine, GatewayConfig(max_text_chars=30)) as g:
        if dialect == "elevenlabs":
            url = (
                f"ws://127.0.0.1:{g.port}/v1/text-to-speech/alice/multi-stream-input?output_format=pcm_24000"
            )
            first = {"text": "Hello there, all is fine. ", "context_id": "a"}
            second = {"text": "Many more words to say. ", "context_id": "a"}
        else:
            url = f"ws://127.0.0.1:{g.port}/tts/websocket"
            first = {"context_id": "a", "transcript": "Hello there, all is fine. ", "continue": True}
            second = {"context_id": "a", "transcript": "Many more words to say. ", "continue": True}
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps(first))
            await ws.send(json.dumps(second))
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 5))
                if message.get("error") == "text_too_long" or message.get("error_code") == "text_too_long":
                    break
            deadline = time.monotonic() + 5
            while not (engine.streams and engine.streams[0].cancelled) and time.monotonic() < deadline:  # noqa: ASYNC110 (another thread)
                await asyncio.sleep(0.05)
            assert engine.streams and engine.streams[0].cancelled


class _Link:
    """The native session's side of a link: what the dialect sends it."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("reply", ["utterance.done", "utterance.interrupted"])
async def test_a_cartesia_cancel_crossing_the_utterances_end_leaves_no_context_behind(reply: str) -> None:
    """A cancel that reaches the gateway as the utterance ends is answered by whichever of done or
    interrupted the engine gives: the socket forgets the context either way (a long conversation
    of many contexts keeps none of them)."""
    socket = CartesiaSocket(cast(Any, None), cast(Any, SimpleNamespace(serve_native=None)))
    link = _Link()
    ctx = _Context("turn-1", "k1", cast(Any, link), False, 2, 24_000, stream=3)
    socket.contexts[ctx.context_id], socket.by_utterance["k1"] = ctx, ctx
    socket.by_stream[(id(link), 3)] = ctx
    await socket.on_text(json.dumps({"context_id": "turn-1", "cancel": True}))
    assert link.sent == [{"type": "speak.cancel", "utterance_id": "k1"}]
    await socket.on_link_message(cast(Any, link), {"type": reply, "utterance_id": "k1"})
    assert socket.contexts == {} and socket.by_stream == {} and socket.by_utterance == {}
