"""POST /v1/audio/speech over real uvicorn: wav, flac and pcm round trips, SSE, and errors."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from engine.api import InvalidRequest
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import GatewayFactory, RunningGateway

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello there. This is a test of the speech endpoint."
GAP_MS = 40


def expected_ms(text: str, speed: float = 1.0) -> int:
    return sum(word_ms(w, speed) + GAP_MS for w in text.split())


async def post(g: RunningGateway, **body: object) -> httpx.Response:
    async with httpx.AsyncClient(base_url=g.http, timeout=30) as http:
        return await http.post("/v1/audio/speech", json=body)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
async def test_file_formats_round_trip(gateway: RunningGateway, fmt: str) -> None:
    response = await post(gateway, model="tts-1", input=TEXT, voice="alice", response_format=fmt)
    assert response.status_code == 200
    assert response.headers["content-type"] == f"audio/{fmt}"
    audio, rate = sf.read(io.BytesIO(response.content), dtype="float32")
    assert rate == 24000
    assert abs(len(audio) / rate * 1000 - expected_ms(TEXT)) <= 2
    engine = gateway.engine
    assert isinstance(engine, FakeEngine)
    first = engine.tone("Hello")
    assert np.allclose(audio[: len(first)], first, atol=2 / 32768)


async def test_mp3_is_the_default(gateway: RunningGateway) -> None:
    response = await post(gateway, input="Hi.")
    assert response.headers["content-type"] == "audio/mpeg"
    assert response.content[:3] == b"ID3"


async def test_pcm_streams_raw_s16le(gateway: RunningGateway) -> None:
    response = await post(gateway, input=TEXT, response_format="pcm")
    assert response.status_code == 200
    assert response.headers["x-sample-rate"] == "24000"
    audio, _ = sf.read(
        io.BytesIO(response.content),
        samplerate=24000,
        channels=1,
        format="RAW",
        subtype="PCM_16",
        dtype="float32",
    )
    assert abs(len(audio) / 24 - expected_ms(TEXT)) <= 2
    assert 0.25 < np.max(np.abs(audio)) < 0.35


async def test_speed_shortens_the_audio(gateway: RunningGateway) -> None:
    response = await post(gateway, input=TEXT, response_format="pcm", speed=2.0)
    samples = len(response.content) // 2
    assert abs(samples / 24 - expected_ms(TEXT, 2.0)) <= 2


async def test_sse_events(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.http, timeout=30) as http:
        async with http.stream(
            "POST",
            "/v1/audio/speech",
            json={"input": TEXT, "stream_format": "sse", "response_format": "pcm", "timestamps": True},
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and "speech.audio.delta" in kinds
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert abs(len(pcm) // 2 / 24 - expected_ms(TEXT)) <= 2
    assert events[-1]["duration_ms"] == round(len(pcm) // 2 / 24)
    words = [w for e in events if e["type"] == "speech.audio.words" for w in e["words"]]
    assert [w["text"] for w in words] == TEXT.split()
    assert all(TEXT[w["char_start"] : w["char_end"]] == w["text"] for w in words)
    assert kinds.index("speech.audio.words") < kinds.index("speech.audio.delta")


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({}, "invalid_message"),
        ({"input": ""}, "invalid_message"),
        ({"input": "   "}, "invalid_message"),
        ({"input": 5}, "invalid_message"),
        ({"input": "hi", "response_format": "ogg"}, "unsupported_output"),
        ({"input": "hi", "model": "whisper-1"}, "invalid_request"),
        ({"input": "hi", "voice": {"name": "x"}}, "invalid_message"),
        ({"input": "hi", "stream_format": "websocket"}, "invalid_message"),
        ({"input": "hi", "speed": 10}, "invalid_message"),
        ({"input": "hi", "speed": "fast"}, "invalid_message"),
        ({"input": "hi", "voice": 3}, "invalid_message"),
        ({"input": "hi", "timestamps": "yes"}, "invalid_message"),
        ({"input": "hi", "voice": "nobody"}, "unknown_voice"),
        ({"input": "x" * 20_001}, "text_too_long"),
    ],
)
async def test_bad_requests_get_400_with_a_json_error(
    gateway: RunningGateway, body: dict[str, object], code: str
) -> None:
    response = await post(gateway, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"


async def test_body_that_is_not_json(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        response = await http.post(
            "/v1/audio/speech", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_message"


async def test_overloaded_is_429_with_retry_after(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(capacity=0))
    response = await post(g, input="hi")
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "overloaded"


async def test_engine_refusal_is_400(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(open_error=InvalidRequest("bad language")))
    response = await post(g, input="hi")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"


async def test_engine_failure_mid_synthesis(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(fail_after_words=2))
    response = await post(g, input=TEXT, response_format="flac")  # whole: the failure has its status
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal"
    response = await post(g, input=TEXT, stream_format="sse")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "internal"
    assert g.engine.load().active == 0


async def test_metrics_count_rest_errors(gateway: RunningGateway) -> None:
    await post(gateway, input="")
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        text = (await http.get("/metrics")).text
    assert 'cadence_errors_total{code="invalid_message"} 1.0' in text


async def test_a_request_wants_the_aligners_words_only_with_timestamps(gateway: RunningGateway) -> None:
    """Without `timestamps` the request says "off": an engine with a forced aligner admits it
    without counting it towards the aligner's share."""
    engine = gateway.engine
    assert isinstance(engine, FakeEngine)
    for body, expected in (({}, "off"), ({"timestamps": True, "stream_format": "sse"}, None)):
        response = await post(gateway, input="Hi.", response_format="pcm", **body)
        assert response.status_code == 200
        assert engine.streams[-1].request.word_alignment == expected, body
