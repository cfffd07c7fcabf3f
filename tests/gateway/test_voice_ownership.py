"""Who may make and use voices, over loopback against real uvicorn: a voice-scoped token clones
no voice (neither registered nor one-off), a registered voice speaks only for the key that made
it (another key gets what an unknown voice gets), and a deleted voice leaves the engine too."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf

from gateway.auth import Authenticator, KeyStore, TokenSigner, new_key
from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)

NO_SUCH_VOICE = "v_0123456789abcdef"


Keys = tuple[Authenticator, str, str]


@pytest.fixture
def keys() -> Keys:
    key_a, stored_a = new_key("alpha", iterations=1000)
    key_b, stored_b = new_key("beta", iterations=1000)
    return Authenticator(KeyStore([stored_a, stored_b]), TokenSigner()), key_a, key_b


def bearer(credential: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {credential}"}


def clip_wav(seconds: float = 2.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


async def register(http: httpx.AsyncClient, key: str) -> str:
    r = await http.post("/v1/voices?name=Grace&text=hello", content=clip_wav(), headers=bearer(key))
    assert r.status_code == 201, r.text
    return str(r.json()["voice_id"])


async def speak_rest(http: httpx.AsyncClient, key: str, voice: str) -> httpx.Response:
    body = {"input": "Hello there.", "voice": voice, "response_format": "pcm"}
    return await http.post("/v1/audio/speech", json=body, headers=bearer(key))


async def speak_ws(ws_url: str, key: str, voice: str) -> dict[str, Any]:
    """The first error or utterance.done of one utterance in `voice`."""
    async with connect(ws_url, additional_headers=bearer(key)) as ws:
        client = Client(ws)
        await client.send(type="session.start", voice=voice)
        await client.send(type="speak.append", utterance_id="u1", text="Hello there.")
        await client.send(type="speak.end", utterance_id="u1")
        while True:
            message = await client.next()
            if isinstance(message, dict) and message["type"] in ("error", "utterance.done"):
                return message


def refusal(answer: httpx.Response | dict[str, Any], voice: str) -> tuple[str, str]:
    """(code, message with the voice's id taken out): equal for every voice the caller may not see."""
    error = answer.json()["error"] if isinstance(answer, httpx.Response) else answer
    return str(error["code"]), str(error["message"]).replace(voice, "<id>")


async def test_a_voice_scoped_token_clones_no_voice(keys: Keys) -> None:
    auth, key, _ = keys
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            r = await http.post("/v1/tokens", json={"voices": ["alice"]}, headers=bearer(key))
            token = r.json()["token"]
            one_off = {
                "input": "Hello there.",
                "voice": "alice",
                "response_format": "pcm",
                "ref_audio": base64.b64encode(clip_wav()).decode(),
            }
            r = await http.post("/v1/audio/speech", json=one_off, headers=bearer(token))
            assert r.status_code == 403, r.headers.get("content-type")
            assert r.json()["error"]["code"] == "unauthorized"
            assert not engine.streams  # nothing reached the engine
            r = await http.post("/v1/voices?name=Grace", content=clip_wav(), headers=bearer(token))
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "unauthorized"
            assert not engine.registered
            # the key itself (no voice scope) clones one-off, as documented
            r = await http.post("/v1/audio/speech", json=one_off, headers=bearer(key))
            assert r.status_code == 200
            assert engine.streams[-1].request.ref_audio is not None


async def test_a_voice_speaks_only_for_the_key_that_made_it(keys: Keys) -> None:
    auth, key_a, key_b = keys
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            voice = await register(http, key_a)
            assert (await speak_rest(http, key_a, voice)).status_code == 200
            assert (await speak_ws(gw.ws, key_a, voice))["type"] == "utterance.done"
            streams_before = len(engine.streams)
            # another key: exactly what a voice that does not exist gets, on REST and WebSocket
            foreign, missing = (
                await speak_rest(http, key_b, voice),
                await speak_rest(http, key_b, NO_SUCH_VOICE),
            )
            assert foreign.status_code == missing.status_code == 400
            assert refusal(foreign, voice) == refusal(missing, NO_SUCH_VOICE)
            assert refusal(foreign, voice)[0] == "unknown_voice"
            foreign_ws, missing_ws = (
                await speak_ws(gw.ws, key_b, voice),
                await speak_ws(gw.ws, key_b, NO_SUCH_VOICE),
            )
            assert refusal(foreign_ws, voice) == refusal(missing_ws, NO_SUCH_VOICE)
            assert refusal(foreign_ws, voice)[0] == "unknown_voice"
            assert len(engine.streams) == streams_before  # the engine never spoke it for key b


async def test_a_deleted_voice_leaves_the_engine_and_speaks_no_more(keys: Keys) -> None:
    auth, key, _ = keys
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            voice = await register(http, key)
            assert voice in engine.registered
            r = await http.delete(f"/v1/voices/{voice}", headers=bearer(key))
            assert r.status_code == 200 and r.json()["deleted"]
            assert voice not in engine.registered
            r = await speak_rest(http, key, voice)
            assert (r.status_code, r.json()["error"]["code"]) == (400, "unknown_voice")
            assert (await speak_ws(gw.ws, key, voice))["code"] == "unknown_voice"
