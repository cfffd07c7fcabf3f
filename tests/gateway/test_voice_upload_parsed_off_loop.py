"""A voice upload (POST /v1/voices with the reference clip as base64 in JSON) is parsed off the
event loop, over real uvicorn on loopback: while its JSON is being parsed the loop that carries
every session's audio still answers other requests, and the clip's base64 is decoded in a thread
too. A small body stays on the loop, a raw upload (the file itself, nothing to parse) still makes
a voice, and a body that is not JSON or not base64, or a clip that is not audio, still gets its
typed 400."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

import gateway.bodies
import gateway.rest
import gateway.voices
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.test_large_bodies_parsed_off_loop import HeldParse, on_event_loop, served_while_held
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)


def clip_wav(seconds: float = 1.5, rate: int = 24_000) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


@pytest.fixture
def gw() -> Iterator[RunningGateway]:
    with run_gateway(FakeEngine(), GatewayConfig()) as g:
        yield g


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per base64 decode of an uploaded clip: whether it ran on the event loop."""
    calls: list[bool] = []

    def b64decode(data: Any, *args: Any, **kwargs: Any) -> bytes:
        calls.append(on_event_loop())
        return base64.b64decode(data, *args, **kwargs)

    monkeypatch.setattr(
        gateway.voices, "base64", SimpleNamespace(b64decode=b64decode, b64encode=base64.b64encode)
    )
    return calls


def hold_json(monkeypatch: pytest.MonkeyPatch, hold_over: int) -> HeldParse:
    """The shared JSON body parser (gateway.bodies.parse_json_body) made to record, and to wait on
    a body over `hold_over` characters."""
    held = HeldParse(json.loads, hold_over=hold_over)
    monkeypatch.setattr(gateway.bodies, "json", SimpleNamespace(loads=held, dumps=json.dumps))
    return held


def _error(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["message"]


async def test_a_large_voice_upload_is_parsed_while_the_loop_serves_others(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch, decoded: list[bool]
) -> None:
    body = json.dumps({"name": "Grace", "text": "hello", "audio": base64.b64encode(clip_wav()).decode()})
    assert len(body) > gateway.bodies.INLINE_BYTES
    held = hold_json(monkeypatch, hold_over=gateway.bodies.INLINE_BYTES)
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        upload = asyncio.ensure_future(
            http.post("/v1/voices", content=body, headers={"Content-Type": "application/json"})
        )
        await served_while_held(gw, held)
        response = await upload
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "Grace" and response.json()["ready"] is True
    assert held.calls == [(len(body), False)]
    assert decoded == [False]  # the clip's base64 too


async def test_a_small_voice_upload_is_parsed_on_the_loop(
    gw: RunningGateway, monkeypatch: pytest.MonkeyPatch, decoded: list[bool]
) -> None:
    held = hold_json(monkeypatch, hold_over=10**9)
    body = {"name": "Tiny", "audio": base64.b64encode(b"RIFF").decode()}  # parsed, then judged
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/voices", json=body)
    assert _error(response) == (
        400,
        "invalid_audio",
        "The audio could not be read: send a WAV, FLAC or OGG file.",
    )
    assert [on_loop for _, on_loop in held.calls] == [True]
    assert decoded == [True]


async def test_a_raw_voice_upload_still_makes_a_voice(gw: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post(
            "/v1/voices?name=Raw&text=hello", content=clip_wav(), headers={"Content-Type": "audio/wav"}
        )
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "Raw" and response.json()["transcript"] == "hello"


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "x", "audio": "' + "A" * 40_000,  # cut short
        "[" * 40_000 + "]" * 40_000,  # nests deeper than the parser goes
        "\ufeff" + "x" * 40_000,
        '{"name": "x", "audio": "AAAA"',  # small, cut short
    ],
    ids=["truncated", "nested-too-deep", "not-json", "small-truncated"],
)
async def test_an_upload_that_is_not_json_is_a_typed_400(gw: RunningGateway, body: str) -> None:
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post(
            "/v1/voices", content=body.encode(), headers={"Content-Type": "application/json"}
        )
    assert _error(response) == (400, "invalid_message", "`body`: not valid JSON")


@pytest.mark.parametrize(
    "audio",
    ["!" + base64.b64encode(clip_wav()).decode(), "!AAA", "é" * 40_000],
    ids=["large", "small", "not-ascii"],
)
async def test_a_clip_that_is_not_base64_is_a_typed_400(gw: RunningGateway, audio: str) -> None:
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/voices", json={"name": "x", "audio": audio})
    assert _error(response) == (400, "invalid_message", "`audio` is not valid base64")


@pytest.mark.parametrize("fields", [{"name": "x"}, {"name": "x", "audio": 5}, ["audio"]])
async def test_an_upload_without_its_clip_is_a_typed_400(gw: RunningGateway, fields: Any) -> None:
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/voices", json=fields)
    assert _error(response) == (400, "invalid_message", "`audio` (the clip file, base64) is required")


async def test_a_large_upload_that_is_not_audio_is_a_typed_400(gw: RunningGateway) -> None:
    body = {"name": "x", "audio": base64.b64encode(b"\0" * 60_000).decode()}
    async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
        response = await http.post("/v1/voices", json=body)
    assert _error(response) == (
        400,
        "invalid_audio",
        "The audio could not be read: send a WAV, FLAC or OGG file.",
    )
