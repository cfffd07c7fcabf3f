"""`cadence serve --gateways 2 --gpus 2` with the null engine (a CPU worker per "GPU"), a real
redis-server and real uvicorn on loopback: two gateway processes on one port, connections spread
over both, barge-in on each, one killed while the other's sessions go on, and a clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from cadence.gateways import gateway_count, gpu_shares, reuseport_socket, serve_gateways
from gateway.auth import new_key
from tests.gateway.cluster.harness import ROOT, Cluster, free_port, wait_until
from tests.integration.wsclient import Client

pytestmark = pytest.mark.timeout(90)
LONG_TEXT = (
    "Two gateway processes share one port, and either may be asked to stop a voice it does not hold. " * 3
)


def test_the_gpus_are_shared_out_disjointly_and_in_order() -> None:
    assert gpu_shares(2, 2, None) == [["0"], ["1"]]
    assert gpu_shares(4, 2, "3,5,6,7") == [["3", "5"], ["6", "7"]]
    assert gpu_shares(3, 2, None) == [["0"], ["1", "2"]]
    with pytest.raises(SystemExit, match="at least as many GPUs"):
        gpu_shares(1, 2, None)
    assert gateway_count("auto", "2") == 2 and gateway_count("auto", None) == 1
    assert gateway_count("auto", "0") == 1 and gateway_count("3", None) == 3
    with pytest.raises(SystemExit):
        gateway_count("0", None)


def test_several_gateways_need_redis() -> None:
    from cadence.engines import EngineOptions
    from cadence.gateways import GatewayPlan
    from gateway.config import GatewayConfig

    plan = GatewayPlan(EngineOptions(name="null"), GatewayConfig(), "127.0.0.1", 0, "warning", False)
    with pytest.raises(SystemExit, match="needs --redis"):
        serve_gateways(plan, 2)


def test_a_reuseport_socket_shares_its_port_but_not_with_a_plain_one() -> None:
    first = reuseport_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = reuseport_socket("127.0.0.1", port)  # the same port: allowed
    plain = socket.socket()
    try:
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    finally:
        for s in (first, second, plain):
            s.close()


class Gateways:
    def __init__(self, workdir: Path, redis_url: str, keys_file: Path) -> None:
        self.port = free_port()
        self.log = open(workdir / "gateways.log", "wb")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("CADENCE_API_KEYS", None)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cadence.cli",
                "serve",
                "--engine",
                "null",
                "--gpus",
                "2",
                "--gateways",
                "auto",
                "--port",
                str(self.port),
                "--redis",
                redis_url,
                "--replica-id",
                "host",
                "--api-keys-file",
                str(keys_file),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=self.log,
        )

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def children(self) -> list[int]:
        """The gateway processes (the parent's children but its resource tracker)."""
        pids = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return [
            int(p)
            for p in pids
            if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        ]

    def replicas(self, key: str) -> list[str]:
        answer = httpx.get(f"{self.http}/v1/cluster", headers=auth(key), timeout=2)
        return sorted(answer.json()["replicas"]) if answer.status_code == 200 else []


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateways, str]]:
    workdir = tmp_path_factory.mktemp("gateways")
    key, stored = new_key("alice", iterations=1_000)
    keys_file = workdir / "keys"
    keys_file.write_text(stored.line() + "\n")
    redis = Cluster(workdir)
    redis.start_redis(persistent=False)
    gateways = Gateways(workdir, redis.redis_url, keys_file)
    try:
        wait_until(lambda: gateways.replicas(key) == ["host/g0", "host/g1"], 40, "two gateways")
        yield gateways, key
    finally:
        if gateways.process.poll() is None:
            gateways.process.send_signal(signal.SIGTERM)
            try:
                gateways.process.wait(20)
            except subprocess.TimeoutExpired:
                gateways.process.kill()
        redis.stop()


def served_by(gateways: Gateways, connections: int) -> Counter[str]:
    """Which process answered each of `connections` new connections to the one port."""
    seen: Counter[str] = Counter()
    for _ in range(connections):
        with httpx.Client() as http:  # a connection (and a source port) of its own
            seen[http.get(f"{gateways.http}/readyz", timeout=2).json()["replica"]] += 1
    return seen


async def speaking(gateways: Gateways, key: str, utterance_id: str) -> Client:
    ws = await websockets.connect(
        f"ws://127.0.0.1:{gateways.port}/v1/stream", additional_headers=auth(key), max_size=None
    )
    client = Client(ws)
    await client.send(type="session.start", pacing="realtime")
    await client.until("session.started")
    await client.send(type="speak.append", utterance_id=utterance_id, text=LONG_TEXT)
    await client.send(type="speak.end", utterance_id=utterance_id)
    packets = 0
    while packets < 5:
        if not isinstance(await client.next(), dict):
            packets += 1
    return client


async def interrupt(gateways: Gateways, key: str, utterance_id: str) -> dict[str, object]:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{gateways.http}/v1/utterances/{utterance_id}/interrupt",
            json={"played_ms": 60},
            headers=auth(key),
        )
    assert response.status_code == 200, response.text
    return dict(response.json())


async def interrupted_on_both(
    gateways: Gateways, key: str, prefix: str, least: int = 8
) -> tuple[list[Client], list[dict[str, object]]]:
    """At least `least` speaking sessions, each interrupted over REST, opened until both processes
    hold some: the kernel spreads connections by a hash of their addresses, so a fixed few may all
    land on one."""
    clients: list[Client] = []
    answers: list[dict[str, object]] = []
    while len(clients) < least or {a["owner"] for a in answers} != {"host/g0", "host/g1"}:
        assert len(clients) < 48, f"every connection reached one gateway: {answers}"
        clients.append(await speaking(gateways, key, f"{prefix}{len(clients)}"))
        answers.append(await interrupt(gateways, key, f"{prefix}{len(clients) - 1}"))
    return clients, answers


def test_connections_land_on_both_gateways(served: tuple[Gateways, str]) -> None:
    gateways, _ = served
    seen = served_by(gateways, 40)
    assert set(seen) == {"host/g0", "host/g1"}, seen
    assert sum(seen.values()) == 40


async def test_barge_in_reaches_the_stream_on_either_gateway(served: tuple[Gateways, str]) -> None:
    """Sessions on both processes; each interrupt goes through the shared port to whichever
    process the connection reaches, which stops it itself or routes it to its owner."""
    gateways, key = served
    clients, answers = await interrupted_on_both(gateways, key, "u")
    try:
        for i, client in enumerate(clients):
            fence = await client.until("utterance.interrupted", f"u{i}")
            assert fence["played_ms"] == answers[i]["played_ms"] == 60
        assert {a["route"] for a in answers} <= {"local", "directory", "broadcast"}
        # and the plain in-band barge-in on each session
        for i, client in enumerate(clients):
            await client.send(type="speak.append", utterance_id=f"v{i}", text=LONG_TEXT)
            await client.send(type="speak.end", utterance_id=f"v{i}")
            await client.until("utterance.started", f"v{i}")
            await client.send(type="speak.cancel", utterance_id=f"v{i}", played_ms=0)
            assert (await client.until("utterance.interrupted", f"v{i}"))["utterance_id"] == f"v{i}"
    finally:
        for client in clients:
            await client.ws.close()


async def test_a_killed_gateway_leaves_the_other_serving_and_comes_back(served: tuple[Gateways, str]) -> None:
    gateways, key = served
    clients, answers = await interrupted_on_both(gateways, key, "k")
    owners = [answer["owner"] for answer in answers]
    children = gateways.children()
    assert len(children) == 2
    victim = children[0]
    os.kill(victim, signal.SIGKILL)
    outcome: dict[str, set[str]] = {"served": set(), "closed": set()}
    try:
        for i, client in enumerate(clients):
            try:
                await client.send(type="speak.append", utterance_id=f"after{i}", text="still here")
                await client.send(type="speak.end", utterance_id=f"after{i}")
                await client.until("utterance.done", f"after{i}")
                outcome["served"].add(str(owners[i]))
            except websockets.ConnectionClosed:
                outcome["closed"].add(str(owners[i]))
        # the killed process's sessions, and only they, are gone; the other's go on speaking
        assert len(outcome["closed"]) == 1 and len(outcome["served"]) == 1, outcome
        assert outcome["closed"] | outcome["served"] == {"host/g0", "host/g1"}
        (survivor,) = outcome["served"]
        # new connections reach the survivor while the parent starts the other again
        assert set(await asyncio.to_thread(served_by, gateways, 10)) <= {"host/g0", "host/g1"}
        await asyncio.to_thread(
            wait_until,
            lambda: len(gateways.children()) == 2 and victim not in gateways.children(),
            20,
            "a replacement",
        )
        await asyncio.to_thread(
            wait_until,
            lambda: set(served_by(gateways, 20)) == {"host/g0", "host/g1"},
            30,
            f"both serving again (survivor {survivor})",
        )
    finally:
        for client in clients:
            await client.ws.close()


def test_sigterm_stops_every_gateway(served: tuple[Gateways, str]) -> None:
    gateways, _ = served
    children = gateways.children()
    gateways.process.send_signal(signal.SIGTERM)
    assert gateways.process.wait(20) == 0
    time.sleep(0.2)
    assert not [p for p in children if Path(f"/proc/{p}").exists()]
