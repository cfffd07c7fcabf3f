"""A large request body (a one-off clone's reference clip as base64 in POST /v1/audio/speech) or a
large dialect frame is parsed off the event loop, over real uvicorn on loopback: while its JSON is
being parsed the loop that carries every session's audio still answers other requests. Small bodies
stay on the loop, and a body that is not JSON or not base64 still gets its typed 400."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

import gateway.bodies
import gateway.compat.bridge
import gateway.compat.cartesia
import gateway.compat.elevenlabs
import gateway.compat.vllm_omni
import gateway.rest
from gateway.compat.bridge import parse_object
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)

HOLD_S = 5.0  # the longest a held parse waits to be let go; longer than any probe's timeout
PROBE_TIMEOUT_S = 2.0


def on_event_loop() -> bool:
    """Whether the calling thread is running an asyncio event loop (the gateway's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class HeldParse:
    """Wraps a parse function: records, per call, the input size and whether it ran on the event
    loop; a call on an input over `hold_over` characters waits until `release()` (or HOLD_S)."""

    def __init__(self, parse: Callable[[Any], Any], hold_over: int) -> None:
        self.parse, self.hold_over = parse, hold_over
        self.calls: list[tuple[int, bool]] = []
        self.entered = threading.Event()
        self._release = threading.Event()

    def __call__(self, raw: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((len(raw), on_event_loop()))
        if len(raw) > self.hold_over:
            self.entered.set()
            self._release.wait(HOLD_S)
        return self.parse(raw, *args, **kwargs)

    def release(self) -> None:
        self._release.set()


def wav_clip_b64(seconds: float = 1.0, rate: int = 24_000) -> str:
    t = np.arange(int(rate * seconds)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def gw() -> Iterator[RunningGateway]:
    # frames up to 256 KiB, so a dialect frame can be large enough to go off the loop
    with run_gateway(FakeEngine(), GatewayConfig(max_message_bytes=256 * 1024)) as g:
        yield g


async def served_while_held(gw: RunningGateway, held: HeldParse) -> None:
    """Once `held` is parsing, another request on the gateway still gets its answer."""
    assert await asyncio.to_thread(held.entered.wait, HOLD_S), "the large body was never parsed"
    try:
        async with httpx.AsyncClient(base_url=gw.http, timeout=PROBE_TIMEOUT_S) as http:
            probe = await http.get("/healthz")
        assert probe.status_code == 200
    finally:
        held.release()


# -- POST /v1/audio/speech --------------------------------------------------------------------


async def test_a_large_speech_body_is_parsed_while_the_loop_serves_others(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    clip = wav_clip_b64()
    body = json.dumps({"input": "Hello there.", "response_format": "pcm", "ref_audio": clip})
    assert len(body) > gateway.bodies.INLINE_BYTES
    held = HeldParse(json.loads, hold_over=gateway.bodies.INLINE_BYTES)
    monkeypatch.setattr(gateway.bodies, "json", SimpleNamespace(loads=held, dumps=json.dumps))
    decoded: list[bool] = []

    def b64decode(data: Any, *args: Any, **kwargs: Any) -> bytes:
        decoded.append(on_event_loop())
        return base64.b64decode(data, *args, **kwargs)

    monkeypatch.setattr(
        gateway.rest, "base64", SimpleNamespace(b64decode=b64decode, b64encode=base64.b64encode)
    )
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        speech = asyncio.ensure_future(
            http.post("/v1/audio/speech", content=body, headers={"Content-Type": "application/json"})
        )
        await served_while_held(gw, held)
        response = await speech
    assert response.status_code == 200, response.text
    assert len(response.content) > 0
    assert held.calls == [(len(body), False)]
    assert decoded == [False]  # the clip's base64 too


async def test_a_small_speech_body_is_parsed_on_the_loop(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldParse(json.loads, hold_over=10**9)
    monkeypatch.setattr(gateway.bodies, "json", SimpleNamespace(loads=held, dumps=json.dumps))
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"})
    assert response.status_code == 200, response.text
    assert [on_loop for _, on_loop in held.calls] == [True]


def _error(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


@pytest.mark.parametrize(
    "body",
    [
        '{"input": "Hello.", "ref_audio": "' + "A" * 40_000,  # cut short
        "[" * 40_000 + "]" * 40_000,  # nests deeper than the parser goes
        "\ufeff" + "x" * 40_000,
    ],
    ids=["truncated", "nested-too-deep", "not-json"],
)
async def test_a_large_body_that_is_not_json_is_a_typed_400(gw: RunningGateway, body: str) -> None:
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/audio/speech", content=body.encode())
    assert _error(response) == (400, "invalid_message", "the body is not valid JSON")


async def test_a_large_clip_that_is_not_base64_is_a_typed_400(gw: RunningGateway) -> None:
    body = {"input": "Hello.", "response_format": "pcm", "ref_audio": "!" + wav_clip_b64()}
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/audio/speech", json=body)
    assert _error(response) == (400, "invalid_audio", "`ref_audio` is not valid base64")


# -- dialect frames ---------------------------------------------------------------------------

PAD = "x" * 20_000  # puts a frame over INLINE_BYTES


def _is_vllm_voice_list(reply: dict[str, Any]) -> bool:
    return reply.get("type") == "voice.list" and "alice" in reply["voices"]


def _is_elevenlabs_bad_text(reply: dict[str, Any]) -> bool:
    return reply == {"error": "invalid_message", "message": "`text` must be a string"}


def _is_cartesia_missing_context(reply: dict[str, Any]) -> bool:
    return reply.get("error_code") == "invalid_request" and "context_id" in reply["error"]


DIALECTS = [
    (gateway.compat.vllm_omni, "/v1/audio/speech/stream", {"type": "voice.list"}, _is_vllm_voice_list),
    (
        gateway.compat.elevenlabs,
        "/v1/text-to-speech/alice/stream-input?output_format=pcm_24000",
        {"text": 5},
        _is_elevenlabs_bad_text,
    ),
    (gateway.compat.cartesia, "/tts/websocket", {"transcript": "Hi."}, _is_cartesia_missing_context),
]


@pytest.mark.parametrize(
    ("module", "path", "frame", "answered"), DIALECTS, ids=["vllm-omni", "elevenlabs", "cartesia"]
)
async def test_a_large_dialect_frame_is_parsed_while_the_loop_serves_others(
    gw: RunningGateway,
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    path: str,
    frame: dict[str, Any],
    answered: Callable[[dict[str, Any]], bool],
) -> None:
    held = HeldParse(parse_object, hold_over=gateway.bodies.INLINE_BYTES)
    monkeypatch.setattr(gateway.compat.bridge, "parse_object", held)
    text = json.dumps({**frame, "pad": PAD})
    assert gateway.bodies.INLINE_BYTES < len(text) < 256 * 1024
    async with websockets.connect(f"ws://127.0.0.1:{gw.port}{path}") as ws:
        await ws.send(text)
        await served_while_held(gw, held)
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert answered(reply), reply  # the frame, parsed off the loop, is acted on as before
    assert held.calls == [(len(text), False)]


@pytest.mark.parametrize(
    ("module", "path", "frame", "answered"), DIALECTS, ids=["vllm-omni", "elevenlabs", "cartesia"]
)
async def test_a_small_dialect_frame_is_parsed_on_the_loop(
    gw: RunningGateway,
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    path: str,
    frame: dict[str, Any],
    answered: Callable[[dict[str, Any]], bool],
) -> None:
    held = HeldParse(parse_object, hold_over=10**9)
    monkeypatch.setattr(gateway.compat.bridge, "parse_object", held)
    text = json.dumps(frame)
    async with websockets.connect(f"ws://127.0.0.1:{gw.port}{path}") as ws:
        await ws.send(text)
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert answered(reply), reply
    assert held.calls == [(len(text), True)]
