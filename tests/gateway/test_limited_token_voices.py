"""A token limited to some voices reads and speaks its key's registered voices but changes none,
over loopback against real uvicorn: its DELETE is refused with 403 `unauthorized`, as its POST is,
and the voice stays registered, listed and speaking; the key itself still deletes it."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.gateway.test_voice_ownership import Keys, bearer, keys, register, speak_rest  # noqa: F401
from tests.integration.conftest import run_gateway

pytestmark = pytest.mark.timeout(60)


async def test_a_voice_scoped_token_may_not_delete_its_keys_voice(keys: Keys) -> None:  # noqa: F811
    auth, key, _ = keys
    engine = FakeEngine()
    with run_gateway(engine, GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            voice = await register(http, key)
            r = await http.post("/v1/tokens", json={"voices": [voice]}, headers=bearer(key))
            token = r.json()["token"]
            r = await http.delete(f"/v1/voices/{voice}", headers=bearer(token))
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "unauthorized"
            # nothing changed: the token still reads and speaks the voice, the engine keeps it
            assert voice in engine.registered
            assert (await http.get(f"/v1/voices/{voice}", headers=bearer(token))).status_code == 200
            listed = (await http.get("/v1/voices", headers=bearer(token))).json()["voices"]
            assert [v["voice_id"] for v in listed] == [voice]
            assert (await speak_rest(http, token, voice)).status_code == 200
            r = await http.delete(f"/v1/voices/{voice}", headers=bearer(key))
            assert r.status_code == 200 and r.json()["deleted"]


async def test_a_token_without_a_voice_list_deletes_like_its_key(keys: Keys) -> None:  # noqa: F811
    auth, key, _ = keys
    with run_gateway(FakeEngine(), GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            voice = await register(http, key)
            token = (await http.post("/v1/tokens", json={}, headers=bearer(key))).json()["token"]
            r = await http.delete(f"/v1/voices/{voice}", headers=bearer(token))
            assert r.status_code == 200 and r.json()["deleted"]


async def test_a_scoped_token_deleting_another_keys_voice_learns_nothing(keys: Keys) -> None:  # noqa: F811
    auth, key_a, key_b = keys
    with run_gateway(FakeEngine(), GatewayConfig(), auth=auth) as gw:
        async with httpx.AsyncClient(base_url=gw.http) as http:
            voice = await register(http, key_a)
            r = await http.post("/v1/tokens", json={"voices": [voice]}, headers=bearer(key_b))
            r = await http.delete(f"/v1/voices/{voice}", headers=bearer(r.json()["token"]))
            # another key's id is unknown to b, whatever b's credentials may do
            assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_voice")
