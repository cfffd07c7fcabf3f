"""Redis faults mid-stream: two `cadence serve` replicas (null engine, API keys, real-time
sessions) and a real redis-server on loopback that is hung (SIGSTOP), killed and restarted, and
restarted empty. While it is away the streams go on without a gap, new sessions get audio, the
probes answer at once, cross-replica operations answer 503 with a reason, nothing answers a bare
500, and each transition is logged once; once it is back the quota counters are exact again
within a second and no voice is lost.

Each latency bound is what the fault may add to the worst the same measurement took, in the same
run and under the same workload, with the store present: a loaded machine (CI runs the whole suite
on 2 cores) slows both alike, while a stall the store causes shows in the fault alone."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import soundfile as sf
import websockets
from websockets.asyncio.client import ClientConnection

from gateway.auth import new_key
from tests.gateway.cluster.harness import Cluster, Replica, port_open, tools_available

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not tools_available(), reason="needs redis-server (scripts/test installs it)"),
]

KEY_ID = "ops"
STREAMS_PER_REPLICA = 3
# ~30 s of audio from the null engine: every workload utterance is still in progress at the end
LONG_TEXT = "Audio keeps flowing to the listener while the shared store is away. " * 6
FAULT_S = 2.0  # how long the store stays away in each test (and how long the baseline runs)
# what the store's absence may add to the baseline's worst (a packet is due every 20 ms)
MAX_GAP_S = 0.25
FIRST_AUDIO_S = 1.0
HEALTHZ_S = 0.1
CROSS_REPLICA_503_S = 0.1
EXACT_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    workdir: Path = tmp_path_factory.mktemp("store-faults")
    key, stored = new_key(KEY_ID, iterations=1_000)
    keys_file = workdir / "keys"
    keys_file.write_text(stored.line() + "\n")
    c = Cluster(workdir)
    try:
        c.start_redis()
        c.start_replicas(2, "null", keys_file, "--quota-sessions", "40", "--quota-utterances", "40")
        yield c, key
    finally:
        c.stop()


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ws_url(replica: Replica) -> str:
    return replica.http.replace("http://", "ws://") + "/v1/stream"


def clip() -> bytes:
    rate = 16_000
    t = np.arange(int(rate * 1.5)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


@dataclass
class Stream:
    """One real-time session on a replica, reading everything it is sent."""

    ws: ClientConnection
    arrivals: list[float] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in self.ws:
                if isinstance(frame, bytes):
                    self.arrivals.append(time.monotonic())
                else:
                    message = json.loads(frame)
                    if message["type"] == "error":
                        self.errors.append(message)

    def largest_gap(self, since: float, until: float = float("inf")) -> float:
        times = [t for t in self.arrivals if since <= t <= until]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


@contextlib.asynccontextmanager
async def streams(c: Cluster, key: str) -> AsyncIterator[list[Stream]]:
    """STREAMS_PER_REPLICA long real-time utterances on each replica, all playing on return."""
    opened: list[Stream] = []
    try:
        for replica in c.replicas:
            for i in range(STREAMS_PER_REPLICA):
                ws = await websockets.connect(ws_url(replica), additional_headers=headers(key), max_size=None)
                stream = Stream(ws)
                opened.append(stream)
                await ws.send(json.dumps({"type": "session.start", "pacing": "realtime"}))
                await ws.send(
                    json.dumps({"type": "speak.append", "utterance_id": f"w{i}", "text": LONG_TEXT})
                )
                await ws.send(json.dumps({"type": "speak.end", "utterance_id": f"w{i}"}))
                stream.task = asyncio.create_task(stream.read())
        deadline = time.monotonic() + 5
        while not all(s.arrivals for s in opened):
            assert time.monotonic() < deadline, [s.errors for s in opened]
            await asyncio.sleep(0.05)
        yield opened
    finally:
        for stream in opened:
            await stream.ws.close()
            if stream.task is not None:
                await stream.task


def worst(times: list[float]) -> float:
    return max(times, default=0.0)


@dataclass
class Probes:
    """What clients saw while the store was away (and around it), or, as the baseline, while it
    was present."""

    statuses: list[tuple[str, int, str]] = field(default_factory=list)
    healthz_s: list[float] = field(default_factory=list)
    first_audio: list[tuple[float, str]] = field(default_factory=list)
    cross_replica_503_s: list[float] = field(default_factory=list)
    voices: list[str] = field(default_factory=list)
    cross_replica_s: list[float] = field(default_factory=list)  # GET /v1/cluster, whatever it answered

    def saw(self, what: str, response: httpx.Response) -> None:
        self.statuses.append((what, response.status_code, response.text))

    def check(self, baseline: Probes) -> None:
        bare = [s for s in self.statuses if s[1] >= 500 and s[1] != 503]
        assert not bare, f"answers that are neither a result nor a clear 503: {bare}"
        for what, status, text in self.statuses:
            if status == 503 and what != "readyz":
                error = json.loads(text)["error"]
                assert error["code"] == "store_unavailable" and "unreachable" in error["message"], text
        healthz_limit = HEALTHZ_S + worst(baseline.healthz_s)
        assert len(self.healthz_s) > 10 and max(self.healthz_s) < healthz_limit, (
            sorted(self.healthz_s)[-5:],
            healthz_limit,
        )
        assert self.first_audio and all(kind in ("audio", "error") for _, kind in self.first_audio)
        first_audio_limit = FIRST_AUDIO_S + worst([dt for dt, _ in baseline.first_audio])
        assert max(dt for dt, _ in self.first_audio) < first_audio_limit, (
            self.first_audio,
            first_audio_limit,
        )
        # the store present, GET /v1/cluster takes two round trips to it: the baseline's allowance
        # for the machine is on the generous side of what a 503 without any needs
        cross_replica_limit = CROSS_REPLICA_503_S + worst(baseline.cross_replica_s)
        assert self.cross_replica_503_s and max(self.cross_replica_503_s) < cross_replica_limit, (
            self.cross_replica_503_s,
            cross_replica_limit,
        )


@contextlib.contextmanager
def health_checked(c: Cluster, probes: Probes) -> Iterator[None]:
    """A load balancer's liveness probe: GET /healthz on each replica every 100 ms, from a thread
    of its own (an independent client, as a load balancer is)."""
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=5) as http:
            while not stop.is_set():
                for replica in c.replicas:
                    started = time.monotonic()
                    response = http.get(f"{replica.http}/healthz")
                    probes.healthz_s.append(time.monotonic() - started)
                    probes.saw("healthz", response)
                stop.wait(0.1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


async def first_audio(replica: Replica, key: str, n: int) -> tuple[float, str]:
    """A new session's time to its first packet (or to a clear error)."""
    started = time.monotonic()
    async with websockets.connect(ws_url(replica), additional_headers=headers(key), max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "pacing": "realtime"}))
        await ws.send(json.dumps({"type": "speak.append", "utterance_id": f"n{n}", "text": "Hello there."}))
        await ws.send(json.dumps({"type": "speak.end", "utterance_id": f"n{n}"}))
        while True:
            frame = await asyncio.wait_for(ws.recv(), 5)
            if isinstance(frame, bytes):
                return time.monotonic() - started, "audio"
            if json.loads(frame)["type"] == "error":
                return time.monotonic() - started, "error"


async def degraded(http: httpx.AsyncClient, replica: Replica) -> bool:
    response = await http.get(f"{replica.http}/readyz")
    assert response.status_code == 200, response.text  # degraded, still serving
    return bool(response.json()["store"]["state"] == "degraded")


async def probe_while(
    c: Cluster, key: str, http: httpx.AsyncClient, probes: Probes, until: Callable[[], bool]
) -> None:
    """Every probe on both replicas, round after round, until `until()`."""
    n = 0
    while not until():
        for replica in c.replicas:
            n += 1
            probes.saw("readyz", await http.get(f"{replica.http}/readyz"))
            probes.saw("metrics", await http.get(f"{replica.http}/metrics", headers=headers(key)))
            started = time.monotonic()
            probes.saw("cluster", await http.get(f"{replica.http}/v1/cluster", headers=headers(key)))
            probes.cross_replica_s.append(time.monotonic() - started)
            interrupt = await http.post(
                f"{replica.http}/v1/utterances/nobody-{n}/interrupt", json={}, headers=headers(key)
            )
            probes.saw("interrupt", interrupt)
            assert interrupt.status_code in (404, 503), interrupt.text
            probes.first_audio.append(await first_audio(replica, key, n))
        await asyncio.sleep(0.2)


async def cross_replica_answers_503_at_once(
    c: Cluster, key: str, http: httpx.AsyncClient, probes: Probes
) -> None:
    """Once a replica knows the store is away: GET /v1/cluster, a cross-replica interrupt and
    the breaker's gauge."""
    for replica in c.replicas:
        deadline = time.monotonic() + 2.0
        while not await degraded(http, replica):
            assert time.monotonic() < deadline, f"{replica.name} did not notice the store was away"
            await asyncio.sleep(0.05)
        for request in (
            lambda r=replica: http.get(f"{r.http}/v1/cluster", headers=headers(key)),
            lambda r=replica: http.post(
                f"{r.http}/v1/utterances/elsewhere/interrupt", json={}, headers=headers(key)
            ),
        ):
            started = time.monotonic()
            response = await request()
            probes.cross_replica_503_s.append(time.monotonic() - started)
            probes.saw("cross-replica", response)
            assert response.status_code == 503, response.text
        metrics = (await http.get(f"{replica.http}/metrics", headers=headers(key))).text
        assert re.search(r"(?m)^cadence_store_breaker_state 1\.0$", metrics)


async def register_voice(c: Cluster, key: str, http: httpx.AsyncClient, probes: Probes, name: str) -> None:
    """The null engine cannot clone: the checked clip is stored and the answer says so (400);
    while the store is away it is kept on the replica and written through later."""
    response = await http.post(
        f"{c.replicas[0].http}/v1/voices?name={name}&text=hello", content=clip(), headers=headers(key)
    )
    probes.saw("voices", response)
    assert response.status_code == 400 and response.json()["voice"]["voice_id"], response.text
    probes.voices.append(response.json()["voice"]["voice_id"])


async def counters(store: aioredis.Redis, c: Cluster) -> tuple[int, int]:
    """(sessions, utterances) of the key, as the store counts them over the replicas."""
    sessions = utterances = 0
    for replica in c.replicas:
        counts = await store.hgetall(f"cadence:usage:{replica.name}")
        sessions += int(counts.get(f"s:{KEY_ID}".encode(), 0))
        utterances += int(counts.get(f"u:{KEY_ID}".encode(), 0))
    return sessions, utterances


async def exact_within(c: Cluster, expected: tuple[int, int], since: float) -> None:
    store = aioredis.Redis(port=c.redis_port)
    try:
        seen = None
        while time.monotonic() - since < EXACT_WITHIN_S:
            with contextlib.suppress(aioredis.RedisError, OSError):
                seen = await counters(store, c)
                if seen == expected:
                    return
            await asyncio.sleep(0.02)
        raise AssertionError(f"counters {seen} are not {expected} within {EXACT_WITHIN_S} s of the return")
    finally:
        await store.aclose()


async def stored_voices(c: Cluster) -> set[str]:
    store = aioredis.Redis(port=c.redis_port)
    try:
        return {m.decode() for m in await store.smembers("cadence:voices")}
    finally:
        await store.aclose()


async def voices_in_store(c: Cluster, voice_ids: set[str], within_s: float) -> None:
    store = aioredis.Redis(port=c.redis_port)
    try:
        deadline = time.monotonic() + within_s
        while True:
            held = {m.decode() for m in await store.smembers("cadence:voices")}
            if set(voice_ids) <= held:
                return
            assert time.monotonic() < deadline, f"voices {set(voice_ids) - held} are not back in the store"
            await asyncio.sleep(0.05)
    finally:
        await store.aclose()


class Logs:
    """The replicas' log lines written during a test."""

    def __init__(self, c: Cluster) -> None:
        self.paths = [c.workdir / f"{r.name}.log" for r in c.replicas]
        self.offsets = [p.stat().st_size for p in self.paths]

    def lines(self, pattern: str) -> list[int]:
        """Per replica, the new lines matching `pattern`."""
        counts = []
        for path, offset in zip(self.paths, self.offsets, strict=True):
            with path.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
            counts.append(len(re.findall(pattern, text)))
        return counts


async def fault(
    c: Cluster, key: str, away: Callable[[], None], back: Callable[[], None], expect_lost_subscription: bool
) -> None:
    """The shared scenario: streams playing and every probe running for FAULT_S with the store
    present (the baseline), then the store taken `away` for FAULT_S with the same probes, then
    `back`; checks what clients saw, the counters, the voices and the logs."""
    logs = Logs(c)
    probes = Probes()
    baseline = Probes()
    async with httpx.AsyncClient(timeout=5) as http, streams(c, key) as playing:
        expected = (len(playing), len(playing))
        await exact_within(c, expected, time.monotonic())  # the store counts right before the fault
        await register_voice(c, key, http, probes, "before")
        voices = await stored_voices(c)  # this test's and the earlier tests'
        calm = time.monotonic()
        with health_checked(c, baseline):
            await probe_while(c, key, http, baseline, lambda: time.monotonic() > calm + FAULT_S)
        since = time.monotonic()
        baseline_gap = worst([s.largest_gap(calm, since) for s in playing])
        assert not [s for s in baseline.statuses if s[1] >= 500], baseline.statuses  # the store is present
        with health_checked(c, probes):
            await asyncio.to_thread(away)  # blocking calls: off the loop that reads the streams
            ends = time.monotonic() + FAULT_S
            prober = asyncio.create_task(probe_while(c, key, http, probes, lambda: time.monotonic() > ends))
            await cross_replica_answers_503_at_once(c, key, http, probes)
            await register_voice(c, key, http, probes, "during")
            # one session on each replica ends while the store cannot hear of it: what the store holds
            # is stale until the replicas write their counts again
            ending = [playing[0], playing[STREAMS_PER_REPLICA]]
            for stream in ending:
                await stream.ws.close()
            playing = [s for s in playing if s not in ending]
            expected = (len(playing), len(playing))
            await prober
            await asyncio.to_thread(back)
            returned = time.monotonic()
            await exact_within(c, expected, returned)
            await voices_in_store(c, voices | set(probes.voices), EXACT_WITHIN_S)
            for replica in c.replicas:
                while await degraded(http, replica):
                    assert time.monotonic() - returned < EXACT_WITHIN_S, f"{replica.name} is still degraded"
                    await asyncio.sleep(0.02)
        gaps = [s.largest_gap(since) for s in playing]
        errors = [e for s in playing for e in s.errors]
    assert max(gaps) < MAX_GAP_S + baseline_gap, (gaps, baseline_gap)
    assert not errors, errors
    probes.check(baseline)
    # each replica said it once, and once that the store was back
    assert logs.lines("shared store unreachable") == [1, 1]
    assert logs.lines("shared store reachable again") == [1, 1]
    lost = logs.lines("subscription lost")
    assert all(n <= 2 for n in lost) and (any(lost) if expect_lost_subscription else not any(lost)), lost


async def test_a_hung_store_stalls_nothing(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    await fault(c, key, c.pause_redis, c.resume_redis, expect_lost_subscription=False)


async def test_a_killed_store_restarted_with_its_data(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster
    await fault(c, key, c.kill_redis, c.start_redis, expect_lost_subscription=True)


async def test_a_store_restarted_empty_gets_everything_back(cluster: tuple[Cluster, str]) -> None:
    c, key = cluster

    def empty() -> None:
        c.start_redis(persistent=False)
        assert port_open(c.redis_port)

    await fault(c, key, c.stop_redis, empty, expect_lost_subscription=True)
