"""A draining gateway over real uvicorn on loopback: once SIGTERM's shutdown has begun, a speech
request on a connection the client kept alive is refused at once (503, Retry-After, the JSON error
body, `shutting_down`) and never reaches the engine, /readyz says 503 "shutting down", and what was
already speaking, over REST and over the WebSocket, finishes whole."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import websockets

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine, word_ms
from tests.integration.conftest import RunningGateway, run_gateway
from tests.integration.wsclient import Client

pytestmark = pytest.mark.timeout(60)

REST_WORDS = ["word"] * 20  # 4.8 s of audio, made in ~1.6 s at the engine's pace below
WS_TEXT = "a long utterance keeps the session busy while the gateway drains " * 4


async def speaking_session(gw: RunningGateway) -> Client:
    """A /v1/stream session with an utterance started: the drain waits for it to finish."""
    client = Client(await websockets.connect(gw.ws, max_size=None))
    await client.send(type="session.start")
    await client.until("session.started")
    await client.send(type="speak.append", utterance_id="u1", text=WS_TEXT)
    await client.send(type="speak.end", utterance_id="u1")
    await client.until("utterance.started", "u1")
    return client


async def until_draining(http: httpx.AsyncClient, within_s: float = 5.0) -> httpx.Response:
    """/readyz on the kept connection, once it no longer says ready."""
    deadline = time.monotonic() + within_s
    while True:
        ready = await http.get("/readyz")
        if ready.status_code != 200:
            return ready
        assert time.monotonic() < deadline, "the gateway still said ready after the signal"
        await asyncio.sleep(0.02)


async def test_a_draining_gateway_refuses_new_speech_and_finishes_what_it_started() -> None:
    engine = FakeEngine(step_s=0.02)  # a 60 ms chunk each 20 ms
    with run_gateway(engine, GatewayConfig(drain_timeout_s=8.0)) as gw:
        session = await speaking_session(gw)
        async with (
            httpx.AsyncClient(base_url=gw.http, timeout=30) as kept,
            httpx.AsyncClient(base_url=gw.http, timeout=30) as streaming,
        ):
            assert (await kept.get("/readyz")).status_code == 200  # the connection the client keeps
            body = {"input": " ".join(REST_WORDS), "response_format": "pcm"}
            async with streaming.stream("POST", "/v1/audio/speech", json=body) as in_flight:
                assert in_flight.status_code == 200
                opened = len(engine.streams)  # the session's utterance and the REST request
                gw.server.handle_exit(signal.SIGTERM, None)  # what the signal runs

                ready = await until_draining(kept)
                assert ready.status_code == 503 and ready.json()["reason"] == "shutting down"
                refused = await kept.post(
                    "/v1/audio/speech", json={"input": "too late", "response_format": "pcm"}
                )
                pcm = await in_flight.aread()

        assert refused.status_code == 503, (refused.status_code, refused.headers)
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.headers["Connection"] == "close"  # the retry takes a new connection
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.json()["error"]["type"] == "server_error"
        assert len(engine.streams) == opened == 2  # the refused request never reached the engine
        # the REST stream started before the drain ends whole, and so does the session's utterance
        assert len(pcm) == 2 * 24 * sum(word_ms(w) + 40 for w in REST_WORDS)
        assert (await session.until("utterance.done", "u1"))["utterance_id"] == "u1"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await session.until("never")
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
