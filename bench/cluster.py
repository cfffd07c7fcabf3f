"""Figures for the cluster: the added latency of a cross-replica interrupt, and the gateway
throughput of 3 replicas behind nginx against 1 (null engine), on this machine.

    .venv/bin/python bench/cluster.py --out deploy/bench/cluster.json

With --twilio: the added latency of the Twilio control channel relayed to the replica holding the
call's media stream, against an agent on that replica (2 replicas, null engine):

    .venv/bin/python bench/cluster.py --twilio --out deploy/bench/cluster-twilio.json

Starts its own redis-server, nginx and `cadence serve --engine null` replicas on loopback ports
(tests/gateway/cluster/harness.py, with the deploy/ configs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.auth import new_key  # noqa: E402
from tests.gateway.cluster.harness import Cluster  # noqa: E402

LONG_TEXT = "A long stretch of speech that the null engine plays out in real time for a while. " * 4


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(pct(ms, 0.9), 3),
        "p99_ms": round(pct(ms, 0.99), 3),
        "max_ms": round(max(ms), 3),
    }


async def interrupt_latency(cluster: Cluster, key: str, rounds: int) -> dict[str, Any]:
    """Interrupt utterances held by r1 through r1 itself and through r2 (one HTTP client each)."""
    r1, r2 = cluster.replicas[0], cluster.replicas[1]
    headers = {"Authorization": f"Bearer {key}"}
    ws = await websockets.connect(
        r1.http.replace("http", "ws") + "/v1/stream", additional_headers=headers, max_size=None
    )
    await ws.send(json.dumps({"type": "session.start"}))
    times: dict[str, list[float]] = {"local": [], "cross": []}

    async def until(kind: str, uid: str) -> None:
        while True:
            frame = await ws.recv()
            if isinstance(frame, str):
                message = json.loads(frame)
                if message["type"] == kind and message.get("utterance_id") == uid:
                    return

    async with httpx.AsyncClient(headers=headers) as http:
        for replica in (r1, r2):  # warm the connections
            await http.get(f"{replica.http}/healthz")
        for i in range(rounds):
            where = "local" if i % 2 == 0 else "cross"
            uid = f"b{i}"
            await ws.send(json.dumps({"type": "speak.append", "utterance_id": uid, "text": LONG_TEXT}))
            await until("utterance.started", uid)
            await asyncio.sleep(0.01)  # the directory write is asynchronous
            target = r1 if where == "local" else r2
            t0 = time.perf_counter()
            response = await http.post(f"{target.http}/v1/utterances/{uid}/interrupt", json={"played_ms": 0})
            elapsed = time.perf_counter() - t0
            if response.status_code != 200:
                raise RuntimeError(
                    f"interrupt {uid} via {target.name}: {response.status_code} {response.text}"
                )
            times[where].append(elapsed)
            await until("utterance.interrupted", uid)
    await ws.close()
    local, cross = summary(times["local"]), summary(times["cross"])
    return {
        "local": local,
        "cross_replica": cross,
        "added_median_ms": round(cross["median_ms"] - local["median_ms"], 3),
        "added_p99_ms": round(cross["p99_ms"] - local["p99_ms"], 3),
    }


async def throughput(base: str, key: str, sessions: int, seconds: float) -> dict[str, Any]:
    """`sessions` clients, each speaking utterances back to back (asap) for `seconds`."""
    headers = {"Authorization": f"Bearer {key}"}
    packets = utterances = errors = 0
    ttfa: list[float] = []
    deadline = time.monotonic() + seconds

    async def client(n: int) -> None:
        nonlocal packets, utterances, errors
        try:
            async with websockets.connect(
                base.replace("http", "ws") + "/v1/stream",
                additional_headers=headers,
                max_size=None,
                open_timeout=30,
            ) as ws:
                await ws.send(json.dumps({"type": "session.start"}))
                i = 0
                while time.monotonic() < deadline:
                    uid = f"c{n}-{i}"
                    i += 1
                    t0 = time.perf_counter()
                    first = True
                    await ws.send(
                        json.dumps(
                            {
                                "type": "speak.append",
                                "utterance_id": uid,
                                "text": "One short sentence, spoken at once.",
                            }
                        )
                    )
                    await ws.send(json.dumps({"type": "speak.end", "utterance_id": uid}))
                    while True:
                        frame = await ws.recv()
                        if isinstance(frame, bytes):
                            packets += 1
                            if first:
                                ttfa.append(time.perf_counter() - t0)
                                first = False
                        elif json.loads(frame)["type"] in ("utterance.done", "error"):
                            break
                    utterances += 1
        except Exception:
            errors += 1

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(sessions)))
    wall = time.monotonic() - started
    return {
        "sessions": sessions,
        "seconds": round(wall, 2),
        "utterances_per_s": round(utterances / wall, 1),
        "packets_per_s": round(packets / wall, 1),
        "errors": errors,
        "ttfa": summary(ttfa) if ttfa else None,
    }


async def twilio_control_latency(cluster: Cluster, key: str, rounds: int) -> dict[str, Any]:
    """Two calls whose media streams are on r1 (a simulated Twilio each); the agent of one is on
    r1 (direct), the other's on r2 (relayed). Each round, on each call in turn: `speak.append` ->
    `utterance.started`, then, once its audio flows, `speak.cancel` -> `utterance.interrupted`."""
    from tests.gateway.twilio.simulator import TwilioSimulator

    r1, r2 = cluster.replicas[0], cluster.replicas[1]
    media = r1.http.replace("http", "ws") + f"/v1/twilio?token={key}"
    headers = {"Authorization": f"Bearer {key}"}
    times: dict[str, dict[str, list[float]]] = {
        w: {"append": [], "cancel": []} for w in ("direct", "relayed")
    }
    async with (
        TwilioSimulator(media, call_sid="CA-direct") as direct_sim,
        TwilioSimulator(media, call_sid="CA-relayed", stream_sid="MZ-relayed") as relayed_sim,
    ):
        agents = {}
        for where, replica, sid in (("direct", r1, "CA-direct"), ("relayed", r2, "CA-relayed")):
            url = replica.http.replace("http", "ws") + f"/v1/twilio/control/{sid}"
            agents[where] = await websockets.connect(url, additional_headers=headers, max_size=None)

        async def until(ws: Any, kind: str, uid: str | None = None) -> None:
            while True:
                message = json.loads(await ws.recv())
                if message["type"] == kind and (uid is None or message.get("utterance_id") == uid):
                    return

        for ws in agents.values():
            await until(ws, "call.started")
        for i in range(rounds):
            for where, ws in agents.items():
                uid = f"u{i}"
                t0 = time.perf_counter()
                await ws.send(json.dumps({"type": "speak.append", "utterance_id": uid, "text": LONG_TEXT}))
                await until(ws, "utterance.started", uid)
                times[where]["append"].append(time.perf_counter() - t0)
                await asyncio.sleep(0.06)  # some audio on the line
                t0 = time.perf_counter()
                await ws.send(json.dumps({"type": "speak.cancel", "utterance_id": uid}))
                await until(ws, "utterance.interrupted", uid)
                times[where]["cancel"].append(time.perf_counter() - t0)
        for ws in agents.values():
            await ws.close()
        assert direct_sim.log.clears and relayed_sim.log.clears  # the cancels reached the lines
    result: dict[str, Any] = {"rounds": rounds}
    for message in ("append", "cancel"):
        direct, relayed = summary(times["direct"][message]), summary(times["relayed"][message])
        result[message] = {
            "direct": direct,
            "relayed": relayed,
            "added_median_ms": round(relayed["median_ms"] - direct["median_ms"], 3),
            "added_p99_ms": round(relayed["p99_ms"] - direct["p99_ms"], 3),
        }
    return result


def start_cluster(workdir: Path, replicas: int, keys_line: str, with_nginx: bool) -> Cluster:
    keys_file = workdir / "keys"
    keys_file.write_text(keys_line + "\n")
    cluster = Cluster(workdir)
    cluster.start_redis()
    cluster.start_replicas(
        replicas,
        "null",
        keys_file,
        "--quota-sessions",
        "100000",
        "--quota-utterances",
        "100000",
        "--quota-chars-per-minute",
        "100000000",
    )
    if with_nginx:
        cluster.start_nginx()
    return cluster


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400, help="interrupts (half local, half cross-replica)")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions in the throughput run")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument(
        "--twilio",
        action="store_true",
        help="only the Twilio control channel: relayed against direct (--rounds per call)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    key, stored = new_key("bench", iterations=1_000)
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()}}
    if args.twilio:
        with tempfile.TemporaryDirectory() as tmp:
            cluster = start_cluster(Path(tmp), 2, stored.line(), with_nginx=False)
            try:
                result["twilio_control"] = asyncio.run(twilio_control_latency(cluster, key, args.rounds))
            finally:
                cluster.stop()
        result["machine"]["load_after"] = os.getloadavg()
        return write(result, args.out)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "a").mkdir()
        cluster = start_cluster(root / "a", 3, stored.line(), with_nginx=True)
        try:
            result["interrupt"] = asyncio.run(interrupt_latency(cluster, key, args.rounds))
            result["throughput_3_replicas_nginx"] = asyncio.run(
                throughput(cluster.front, key, args.sessions, args.seconds)
            )
        finally:
            cluster.stop()
        (root / "b").mkdir()
        single = start_cluster(root / "b", 1, stored.line(), with_nginx=True)
        try:
            result["throughput_1_replica_nginx"] = asyncio.run(
                throughput(single.front, key, args.sessions, args.seconds)
            )
        finally:
            single.stop()
    return write(result, args.out)


def write(result: dict[str, Any], out: str | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
