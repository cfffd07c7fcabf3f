"""Three `cadence serve` replicas (eSpeak) with a real redis-server and a real nginx in front,
all on loopback, configured from deploy/: shared voices, quotas across replicas, an interrupt
sent to the wrong replica, Redis restarted, a replica killed, and metrics that add up."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from gateway.auth import new_key
from tests.gateway.cluster.harness import Cluster, tools_available, wait_until
from tests.integration.wsclient import Client

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not tools_available(), reason="needs redis-server and nginx (scripts/test installs them)"
    ),
]

LONG_TEXT = (
    "Every replica in this cluster speaks through the same front, and an interrupt may arrive "
    "at any of them while the audio keeps flowing to the listener for a good while longer."
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    workdir: Path = tmp_path_factory.mktemp("cluster")
    keys: dict[str, str] = {}
    lines = []
    for name in ("alice", "bob", "carol"):
        key, stored = new_key(name, iterations=1_000)
        keys[name] = key
        lines.append(stored.line())
    keys_file = workdir / "keys"
    keys_file.write_text("\n".join(lines) + "\n")
    c = Cluster(workdir)
    try:
        c.start_redis()
        c.start_replicas(3, "espeak", keys_file, "--quota-sessions", "2")
        c.start_nginx()
        yield c, keys
    finally:
        c.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/stream"


async def open_session(base: str, key: str, **start: Any) -> Client:
    ws = await websockets.connect(ws_url(base), additional_headers=auth(key), max_size=None)
    client = Client(ws)
    # a session over quota is refused as soon as it opens: the error is read from what came
    with contextlib.suppress(websockets.ConnectionClosed):
        await client.send(type="session.start", **start)
    return client


def clip() -> bytes:
    rate = 16_000
    t = np.arange(int(rate * 1.5)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def metric_total(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"(?m)^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text))


def test_a_voice_registered_on_one_replica_is_seen_by_the_others(
    cluster: tuple[Cluster, dict[str, str]],
) -> None:
    c, keys = cluster
    r1, r2, r3 = c.replicas
    # eSpeak cannot clone: the checked clip is stored (400 invalid_request, "ready": false)
    response = httpx.post(
        f"{r1.http}/v1/voices?name=Ada&text=hello", content=clip(), headers=auth(keys["alice"])
    )
    assert response.status_code == 400, response.text
    voice_id = response.json()["voice"]["voice_id"]
    for replica in (r2, r3):
        wait_until(
            lambda r=replica: (
                httpx.get(f"{r.http}/v1/voices/{voice_id}", headers=auth(keys["alice"])).status_code == 200
            ),
            5,
            "the shared voice",
        )
        listed = httpx.get(f"{replica.http}/v1/voices", headers=auth(keys["alice"])).json()["voices"]
        assert [v["voice_id"] for v in listed] == [voice_id] and listed[0]["name"] == "Ada"
    # another key sees nothing, anywhere
    assert httpx.get(f"{r2.http}/v1/voices/{voice_id}", headers=auth(keys["bob"])).status_code == 404
    c.workdir.joinpath("voice_id").write_text(voice_id)


async def test_session_quota_holds_across_replicas(cluster: tuple[Cluster, dict[str, str]]) -> None:
    c, keys = cluster
    r1, r2, r3 = c.replicas
    first = await open_session(r1.http, keys["bob"])
    second = await open_session(r2.http, keys["bob"])
    assert (await first.until("session.started"))["type"] == "session.started"
    await second.until("session.started")
    third = await open_session(r3.http, keys["bob"])
    refused = await third.until("error")
    assert refused["code"] == "quota_exceeded"
    await asyncio.sleep(0.1)
    assert third.ws.close_code == 1008
    await first.ws.close()
    await asyncio.sleep(0.3)
    fourth = await open_session(r3.http, keys["bob"])
    assert (await fourth.until("session.started"))["type"] == "session.started"
    await second.ws.close()
    await fourth.ws.close()


async def test_an_interrupt_sent_to_another_replica_reaches_the_stream(
    cluster: tuple[Cluster, dict[str, str]],
) -> None:
    c, keys = cluster
    r1, r2, _ = c.replicas
    client = await open_session(r1.http, keys["carol"], pacing="realtime")
    await client.until("session.started")
    await client.send(type="speak.append", utterance_id="u-cross", text=LONG_TEXT)
    await client.send(type="speak.end", utterance_id="u-cross")
    packets = 0
    while packets < 25:  # half a second of audio on the wire
        if not isinstance(await client.next(), dict):
            packets += 1
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{r2.http}/v1/utterances/u-cross/interrupt", json={"played_ms": 400}, headers=auth(keys["carol"])
        )
        # the wrong key cannot reach it: a 404, as for an unknown id
        wrong = await http.post(
            f"{r2.http}/v1/utterances/u-cross/interrupt", json={}, headers=auth(keys["bob"])
        )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["owner"] == "r1" and answer["replica"] == "r2" and answer["route"] == "directory"
    on_socket = await client.until("utterance.interrupted", "u-cross")
    assert on_socket["played_ms"] == answer["played_ms"] == 400
    assert on_socket["last_word"] == answer["last_word"]
    words = client.got.words_of("u-cross")
    heard = [w for w in words if w["end_ms"] <= 400]
    assert answer["last_word"] is not None and answer["last_word"]["text"] == heard[-1]["text"]
    assert LONG_TEXT.startswith(answer["spoken_text"])
    assert wrong.status_code == 404
    await client.ws.close()


async def test_metrics_of_the_replicas_add_up(cluster: tuple[Cluster, dict[str, str]]) -> None:
    c, keys = cluster

    def total() -> float:
        return sum(
            metric_total(
                httpx.get(f"{r.http}/metrics", headers=auth(keys["alice"])).text, "cadence_utterances_total"
            )
            for r in c.replicas
            if r.process.poll() is None
        )

    before = total()
    for i in range(4):  # through nginx: least_conn spreads them
        client = await open_session(c.front, keys["alice"])
        await client.send(type="speak.append", utterance_id=f"m{i}", text="Count me.")
        await client.send(type="speak.end", utterance_id=f"m{i}")
        await client.until("utterance.done", f"m{i}")
        await client.ws.close()
    assert total() - before == 4
    access = (c.workdir / "nginx" / "logs" / "access.log").read_text()
    assert len({m for m in re.findall(r"127\.0\.0\.1:(\d+) [0-9.]+$", access, re.M)}) >= 2  # spread


async def test_restarting_redis_loses_no_voice(cluster: tuple[Cluster, dict[str, str]]) -> None:
    c, keys = cluster
    voice_id = c.workdir.joinpath("voice_id").read_text()
    c.stop_redis()
    c.start_redis()
    import redis as redis_sync

    store = redis_sync.Redis.from_url(c.redis_url)
    assert store.sismember("cadence:voices", voice_id)  # from the AOF, before any replica resyncs
    assert json.loads(store.hget(f"cadence:voice:{voice_id}", "meta"))["name"] == "Ada"
    store.close()
    # the replicas reconnect and keep serving it, and control routing works again
    for replica in c.replicas:
        wait_until(
            lambda r=replica: (
                httpx.get(f"{r.http}/v1/voices/{voice_id}", headers=auth(keys["alice"])).status_code == 200
            ),
            5,
            "the voice after the restart",
        )


async def test_killing_a_replica_fails_only_its_sessions(cluster: tuple[Cluster, dict[str, str]]) -> None:
    c, keys = cluster
    r1, r2, r3 = c.replicas
    survivor = await open_session(r1.http, keys["alice"], pacing="realtime")
    doomed = await open_session(r3.http, keys["carol"], pacing="realtime")
    for client in (survivor, doomed):
        await client.until("session.started")
        await client.send(type="speak.append", utterance_id="k", text=LONG_TEXT[:120])
        await client.send(type="speak.end", utterance_id="k")
        await client.until("utterance.started", "k")
    c.kill(r3)
    with pytest.raises(websockets.ConnectionClosed):
        for _ in range(1000):
            await doomed.next(5)
    done = await survivor.until("utterance.done", "k", wait_s=20)
    assert done["duration_ms"] > 1000
    await survivor.ws.close()
    # new sessions through nginx all land on the live replicas
    for i in range(4):
        client = await open_session(c.front, keys["alice"])
        started = await client.until("session.started")
        assert started["type"] == "session.started"
        await client.send(type="speak.append", utterance_id=f"n{i}", text="Still here.")
        await client.send(type="speak.end", utterance_id=f"n{i}")
        await client.until("utterance.done", f"n{i}")
        await client.ws.close()
