"""Edges of the HTTP surface over real uvicorn on loopback: a whole-file (flac) request whose client
leaves, a one-off clone's clip decoded off the event loop, the voice upload's size limit, and
webhook deliveries to a URL no attempt can reach or to a receiver that never finishes answering."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

import gateway.rest
from gateway.config import GatewayConfig
from gateway.quotas import QuotaLimits
from gateway.voices import decode_clip
from gateway.webhooks import RetryPolicy, WebhookSender
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)


def _speech_request(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        "POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def test_a_flac_client_that_leaves_frees_its_engine_stream_and_quota() -> None:
    # flac is sent whole at the end: ~40 words take seconds to make, and the client leaves first
    engine = FakeEngine(step_s=0.05)
    config = GatewayConfig(quota_limits=QuotaLimits(utterances=4), quota_anonymous=True)
    with run_gateway(engine, config) as gw:
        quotas = gw.server.gateway.quotas
        sock = socket.create_connection(("127.0.0.1", gw.port))
        sock.sendall(_speech_request({"input": "word " * 40, "response_format": "flac"}))
        deadline = time.monotonic() + 5
        while not engine.active:  # the request reached the engine
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert quotas.usage("anonymous") == (0, 1)
        sock.close()
        deadline = time.monotonic() + 1.5
        while engine.active or quotas.usage("anonymous") != (0, 0):
            assert time.monotonic() < deadline, (len(engine.active), quotas.usage("anonymous"))
            await asyncio.sleep(0.02)
        assert engine.streams[0].cancelled and not engine.streams[0].finished


async def test_a_flac_client_that_stays_gets_the_whole_file() -> None:
    engine = FakeEngine(step_s=0.0)
    with run_gateway(engine) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
            response = await http.post(
                "/v1/audio/speech", json={"input": "one two three", "response_format": "flac"}
            )
        assert response.status_code == 200
        audio, rate = sf.read(io.BytesIO(response.content), dtype="float32")
        whole_ms = sum(word_ms(w) + 40 for w in ("one", "two", "three"))  # words and their gaps
        assert rate == 24_000 and abs(len(audio) * 1000 / rate - whole_ms) <= 2
        assert not engine.active


async def test_a_reference_clip_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_on_loop: list[bool] = []

    def spy(data: bytes) -> tuple[np.ndarray, int]:
        try:
            asyncio.get_running_loop()
            decoded_on_loop.append(True)
        except RuntimeError:
            decoded_on_loop.append(False)
        return decode_clip(data)

    monkeypatch.setattr(gateway.rest, "decode_clip", spy)
    t = np.arange(32_000) / 16_000
    buffer = io.BytesIO()
    sf.write(buffer, (0.4 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16_000, format="WAV")
    clip = base64.b64encode(buffer.getvalue()).decode()
    engine = FakeEngine()
    with run_gateway(engine) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
            good = await http.post(
                "/v1/audio/speech", json={"input": "Hello.", "response_format": "pcm", "ref_audio": clip}
            )
            silent = io.BytesIO()
            sf.write(silent, np.zeros(32_000, np.float32), 16_000, format="WAV")
            bad = await http.post(
                "/v1/audio/speech",
                json={"input": "Hello.", "ref_audio": base64.b64encode(silent.getvalue()).decode()},
            )
    assert good.status_code == 200, good.text
    assert engine.streams[0].request.ref_audio is not None
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_audio"
    assert "silent" in bad.json()["error"]["message"]
    assert decoded_on_loop == [False, False]


async def test_a_raw_voice_upload_over_the_limit_is_413() -> None:
    config = GatewayConfig(max_voice_upload_bytes=64 * 1024)
    with run_gateway(FakeEngine(), config) as gw:
        async with httpx.AsyncClient(base_url=gw.http, timeout=30) as http:
            over = await http.post(
                "/v1/voices?name=big",
                content=b"\0" * (70 * 1024),
                headers={"Content-Type": "audio/wav"},
            )
            assert over.status_code == 413, over.text
            assert over.json()["error"]["code"] == "invalid_audio"
            # base64 in JSON may be 4/3 of the limit: a body that size is read, and its clip judged
            within = await http.post(
                "/v1/voices",
                json={"name": "x", "audio": base64.b64encode(b"\0" * (60 * 1024)).decode()},
            )
            assert within.status_code == 400 and "could not be read" in within.json()["error"]["message"]


async def test_a_webhook_url_no_attempt_can_reach_fails_the_delivery() -> None:
    sender = WebhookSender("secret", RetryPolicy(attempts=3, first_delay_s=0.01, jitter=0.0))
    task = sender.submit("http://[::1/hooks", "utterance.interrupted", {"n": 1})
    assert task is not None
    assert await asyncio.wait_for(task, 5) is False
    assert sender.stats.failed == 1 and sender.stats.attempts == 1 and sender.in_flight == 0
    await sender.close()


async def test_a_webhook_attempt_is_bounded_by_its_timeout_as_a_whole() -> None:
    """A receiver that trickles its answer, one byte at a time, never lets httpx's per-read
    timeout pass; the attempt's own timeout still ends it."""
    stop = asyncio.Event()

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sender = WebhookSender("secret", RetryPolicy(attempts=1, timeout_s=0.5, jitter=0.0))
    try:
        started = time.monotonic()
        task = sender.submit(f"http://127.0.0.1:{port}/hooks", "utterance.interrupted", {"n": 1})
        assert task is not None
        delivered = await asyncio.wait_for(task, 10)
        took = time.monotonic() - started
        assert delivered is False and sender.stats.failed == 1
        assert took < 1.5, took  # the full answer takes ~3.8 s
    finally:
        stop.set()
        await sender.close()
        server.close()
        await server.wait_closed()
