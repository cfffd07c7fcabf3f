"""Keys, tokens, origins, quotas, the voice registry, engine restarts and slow clients, over
loopback against real uvicorn."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed

from gateway.auth import Authenticator, KeyStore, TokenSigner, new_key
from gateway.config import GatewayConfig
from gateway.quotas import QuotaLimits
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory, RunningGateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def keys() -> tuple[Authenticator, str, str]:
    key_a, stored_a = new_key("alpha", iterations=1000)
    key_b, stored_b = new_key("beta", iterations=1000)
    return Authenticator(KeyStore([stored_a, stored_b]), TokenSigner()), key_a, key_b


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _close_code(url: str, **options: object) -> tuple[int | None, str]:
    async with connect(url, **options) as ws:
        try:
            await asyncio.wait_for(ws.recv(), 5)
            await asyncio.wait_for(ws.recv(), 5)
        except ConnectionClosed:
            pass
        return ws.close_code, ws.close_reason or ""


async def test_keys_guard_rest_and_websocket(gateway_factory: GatewayFactory, keys) -> None:
    auth, key, _ = keys
    gw = gateway_factory(FakeEngine(), auth=auth)
    async with httpx.AsyncClient(base_url=gw.http) as http:
        assert (await http.get("/healthz")).status_code == 200  # public
        assert (await http.get("/readyz")).status_code == 200
        r = await http.post("/v1/audio/speech", json={"input": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (await http.get("/metrics")).status_code == 401
        r = await http.post("/v1/audio/speech", json={"input": "hi"}, headers=_auth(key + "x"))
        assert r.status_code == 401
        r = await http.post("/v1/audio/speech", json={"input": "hi"}, headers=_auth(key))
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"  # OpenAI's default
    code, reason = await _close_code(gw.ws)
    assert code == 1008 and "credentials" in reason
    code, _ = await _close_code(gw.ws + "?token=forged.token")
    assert code == 1008
    async with connect(gw.ws, additional_headers=_auth(key)) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="hello there", flush=True)
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")


async def test_browser_tokens_and_origins(gateway_factory: GatewayFactory, keys) -> None:
    auth, key, _ = keys
    gw = gateway_factory(FakeEngine(), auth=auth)
    async with httpx.AsyncClient(base_url=gw.http) as http:
        r = await http.post("/v1/tokens", json={"ttl_s": 60, "voices": ["alice"]}, headers=_auth(key))
        assert r.status_code == 200
        token = r.json()["token"]
        assert r.json()["expires_at"] > time.time()
        assert (
            await http.post("/v1/tokens", json={}, headers=_auth(token))
        ).status_code == 401  # not with a token
        assert (await http.post("/v1/tokens", json={"ttl_s": 10**9}, headers=_auth(key))).status_code == 400
        # REST with the token: its voice scope holds
        r = await http.post("/v1/audio/speech", json={"input": "hi", "voice": "bob"}, headers=_auth(token))
        assert r.status_code == 403
        r = await http.post("/v1/audio/speech", json={"input": "hi", "voice": "alice"}, headers=_auth(token))
        assert r.status_code == 200
    own_origin = {"Origin": gw.http}
    async with connect(f"{gw.ws}?token={token}", additional_headers=own_origin) as ws:
        c = Client(ws)
        await c.send(type="session.start", voice="bob")
        await c.send(type="speak.append", utterance_id="u1", text="hi")
        error = await c.until("error")
        assert error["code"] == "unauthorized"
    code, reason = await _close_code(
        f"{gw.ws}?token={token}", additional_headers={"Origin": "https://evil.example"}
    )
    assert code == 1008 and "origin" in reason


async def test_quotas_over_the_wire(gateway_factory: GatewayFactory) -> None:
    config = GatewayConfig(
        quota_limits=QuotaLimits(sessions=1, utterances=1, chars_per_minute=50), quota_anonymous=True
    )
    gw = gateway_factory(FakeEngine(step_s=0.01), config)
    async with connect(gw.ws) as ws:
        code, reason = await _close_code(gw.ws)  # a second session of the same (anonymous) key
        assert code == 1008 and "sessions" in reason
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="one two three four")
        await c.until("utterance.started", "u1")
        await c.send(type="speak.append", utterance_id="u2", text="x")
        assert (await c.until("error", "u2"))["code"] == "quota_exceeded"
        await c.send(type="speak.append", utterance_id="u1", text="y" * 40)
        assert (await c.until("error", "u1"))["code"] == "rate_limited"
        await c.send(type="speak.cancel", utterance_id="u1")
        await c.until("utterance.interrupted", "u1")
    async with httpx.AsyncClient(base_url=gw.http) as http:
        r = await http.post("/v1/audio/speech", json={"input": "z" * 45})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limited"


async def test_a_client_that_leaves_mid_utterance_gives_its_quota_back(
    gateway_factory: GatewayFactory,
) -> None:
    config = GatewayConfig(
        quota_limits=QuotaLimits(sessions=1, utterances=1, chars_per_minute=10_000), quota_anonymous=True
    )
    gw = gateway_factory(FakeEngine(step_s=0.05), config)
    quotas = gw.server.config.app.state.gateway.quotas
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await c.send(
            type="speak.append", utterance_id="u1", text="a long utterance that is still playing " * 5
        )
        await c.until("utterance.started", "u1")
        assert quotas.usage("anonymous") == (1, 1)
    deadline = time.monotonic() + 5
    while quotas.usage("anonymous") != (0, 0):  # the session's end is seen by the server
        assert time.monotonic() < deadline, quotas.usage("anonymous")
        await asyncio.sleep(0.02)
    async with connect(gw.ws) as ws:  # the key may speak again
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u2", text="again")
        await c.send(type="speak.end", utterance_id="u2")
        await c.until("utterance.done", "u2")
        assert not c.got.of_type("error")


def _clip(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    audio = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    buffer = io.BytesIO()
    sf.write(buffer, audio, rate, format="WAV")
    return buffer.getvalue()


async def test_voice_registry(gateway_factory: GatewayFactory, keys, tmp_path) -> None:
    auth, key_a, key_b = keys
    engine = FakeEngine()
    gw = gateway_factory(
        engine, GatewayConfig(voices_dir=str(tmp_path), max_voice_upload_bytes=200_000), auth=auth
    )
    async with httpx.AsyncClient(base_url=gw.http, headers=_auth(key_a)) as http:
        r = await http.post(
            "/v1/voices", json={"name": "Me", "text": "hello", "audio": base64.b64encode(_clip(2.0)).decode()}
        )
        assert r.status_code == 201, r.text
        voice = r.json()
        assert voice["ready"] and voice["duration_s"] == 2.0 and voice["voice_id"] in engine.registered
        r = await http.post(
            "/v1/voices?name=Raw", content=_clip(1.5, channels=2), headers={"content-type": "audio/wav"}
        )
        assert r.status_code == 201
        listed = (await http.get("/v1/voices")).json()
        assert {v["name"] for v in listed["voices"]} == {"Me", "Raw"} and "alice" in listed["presets"]
        assert len(list(tmp_path.glob("v_*.flac"))) == 2
        for body, needle in [
            ({"name": "x", "audio": base64.b64encode(_clip(0.4)).decode()}, "at least 1 s"),
            ({"name": "x", "audio": "!!!"}, "base64"),
            ({"name": "", "audio": base64.b64encode(_clip(2.0)).decode()}, "name"),
            ({"name": "x", "audio": base64.b64encode(b"not audio at all").decode()}, "could not be read"),
        ]:
            r = await http.post("/v1/voices", json=body)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        r = await http.post("/v1/voices?name=big", content=b"\0" * 300_000)
        assert r.status_code == 413
        # another key sees none of them and cannot delete them
        other = {"Authorization": f"Bearer {key_b}"}
        assert (await http.get("/v1/voices", headers=other)).json()["voices"] == []
        assert (await http.delete(f"/v1/voices/{voice['voice_id']}", headers=other)).status_code == 404
        assert (await http.delete("/v1/voices/..%2F..%2Fetc")).status_code == 404
        r = await http.delete(f"/v1/voices/{voice['voice_id']}")
        assert r.status_code == 200 and r.json()["deleted"]
        assert len(list(tmp_path.glob("v_*.flac"))) == 1


async def test_voice_registry_with_an_engine_that_cannot_clone(gateway_factory: GatewayFactory) -> None:
    espeak = pytest.importorskip("engine.espeak.engine")
    try:
        engine = espeak.EspeakEngine()
    except Exception as exc:
        pytest.skip(f"eSpeak unavailable: {exc}")
    gw = gateway_factory(engine)
    async with httpx.AsyncClient(base_url=gw.http) as http:
        r = await http.post("/v1/voices?name=Me", content=_clip(2.0))
        assert r.status_code == 400
        body = r.json()
        assert body["error"]["code"] == "invalid_request" and "cannot" in body["error"]["message"]
        assert body["voice"]["ready"] is False
        assert (await http.get("/v1/voices")).json()["voices"][0]["ready"] is False


async def test_a_dead_engine_is_restarted_and_readyz_says_so(gateway: RunningGateway) -> None:
    engine: FakeEngine = gateway.engine  # type: ignore[assignment]
    engine.started = False  # the worker "died": load().ready is False
    async with httpx.AsyncClient(base_url=gateway.http) as http:
        for _ in range(50):
            body = (await http.get("/readyz")).json()
            if body["engine_restarts"] >= 1 and body["ready"]:
                break
            await asyncio.sleep(0.1)
        assert body["ready"] and body["engine_restarts"] >= 1
        assert "cadence_engine_restarts_total 1.0" in (await http.get("/metrics")).text


async def test_a_stalled_reader_is_closed_and_frees_its_engine_streams(
    gateway_factory: GatewayFactory,
) -> None:
    engine = FakeEngine(chunk_ms=200)
    config = GatewayConfig(slow_client_timeout_s=1.0, send_queue_high=20, send_queue_low=5)
    gw = gateway_factory(engine, config)
    gateway = gw.server.gateway
    async with connect(gw.ws, max_queue=1, close_timeout=0.5) as ws:
        ws.transport.pause_reading()  # a client that stops reading
        c = Client(ws)
        await c.send(
            type="session.start", output={"encoding": "pcm_f32le", "sample_rate": 48000, "packet_ms": 100}
        )
        await c.send(type="speak.append", utterance_id="u1", text="word " * 2000)
        await c.send(type="speak.end", utterance_id="u1")
        for _ in range(100):
            await asyncio.sleep(0.1)
            if not gateway.sessions and not engine.active:
                break
        assert not gateway.sessions and not engine.active
        assert engine.streams[0].cancelled
        # a healthy session meanwhile is unaffected
    async with connect(gw.ws) as ws2:
        c2 = Client(ws2)
        await c2.send(type="speak.append", utterance_id="u1", text="still fine", flush=True)
        await c2.send(type="speak.end", utterance_id="u1")
        await c2.until("utterance.done", "u1")
    async with httpx.AsyncClient(base_url=gw.http) as http:
        metrics = (await http.get("/metrics")).text
    assert 'cadence_errors_total{code="slow_client"} 1.0' in metrics
    assert "cadence_session_queue_bytes " in metrics and "process_open_fds" in metrics
