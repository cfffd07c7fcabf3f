"""Soak: many concurrent /v1/stream sessions against the real gateway (eSpeak) for minutes.

Each session loops: one utterance (a sentence, 100 ms packets), read to `utterance.done`, "play"
it (sleep its duration), pause 0.5-2 s; every tenth utterance is cut by a `speak.cancel` half way.
Sessions start spread over the first 20 s. The gateway's own /metrics give RSS, open file
descriptors and live asyncio tasks: before any client, after warm-up, at the end with every
session still open, and after all have left. Errors: `error` messages, unexpected closes,
utterances that never finish (30 s), malformed packets.

    python -m scripts.soak --sessions 500 --minutes 10 --out deploy/bench/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import websockets

from gateway.messages import unpack_packet
from scripts.bench_common import gateway_process, run_record, write_json

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "Your order has shipped and should arrive on Thursday.",
    "I have booked a table for two at seven thirty.",
    "The weather tomorrow will be sunny with a light breeze.",
    "Please hold while I transfer you to the right department.",
    "请帮我订一台 iPhone 15，谢谢。",
]
WATCHED = ("process_resident_memory_bytes", "process_open_fds", "cadence_event_loop_tasks",
           "cadence_active_sessions", "cadence_active_utterances", "cadence_session_queue_bytes")


def scrape(http: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for name in WATCHED:
        match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        if match:
            out[name] = float(match.group(1))
    return out


class Tally:
    def __init__(self) -> None:
        self.utterances = 0
        self.interrupted = 0
        self.packets = 0
        self.audio_s = 0.0
        self.errors: Counter[str] = Counter()
        self.refused = 0  # `overloaded`: retried after Retry-After, as a client should
        self.ttfa: list[float] = []


async def session(url: str, index: int, stop_at: float, tally: Tally, rng: random.Random) -> None:
    await asyncio.sleep(rng.uniform(0, 20))
    try:
        async with websockets.connect(url, max_size=None, open_timeout=30, ping_interval=None) as ws:
            await ws.send(json.dumps({"type": "session.start", "output": {"packet_ms": 100}}))
            n = 0
            while time.monotonic() < stop_at:
                n += 1
                uid = f"u{n}"
                cut = n % 10 == 0
                sent = time.monotonic()
                await ws.send(json.dumps({"type": "speak.append", "utterance_id": uid,
                                          "text": rng.choice(SENTENCES)}))
                await ws.send(json.dumps({"type": "speak.end", "utterance_id": uid}))
                duration = await _read_utterance(ws, uid, sent, cut, tally)
                if duration == -1:  # refused (overloaded): back off, then a new utterance
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    continue
                if duration is None:
                    return
                await asyncio.sleep(duration / 1000 + rng.uniform(0.5, 2.0))
            await ws.send(json.dumps({"type": "session.end"}))
            while True:
                frame = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(frame, str) and json.loads(frame)["type"] == "session.ended":
                    break
    except websockets.ConnectionClosedOK:
        pass
    except Exception as exc:  # an unexpected close, a timeout
        tally.errors[f"{type(exc).__name__}"] += 1


async def _read_utterance(ws: Any, uid: str, sent: float, cut: bool, tally: Tally) -> int | None:
    deadline = time.monotonic() + 30
    first = True
    got = 0
    while True:
        frame = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
        if isinstance(frame, bytes):
            header, payload = unpack_packet(frame)
            tally.packets += 1
            got += len(payload) // 2
            if first:
                tally.ttfa.append(time.monotonic() - sent)
                first = False
                if cut:
                    await ws.send(json.dumps({"type": "speak.cancel", "utterance_id": uid}))
            continue
        message = json.loads(frame)
        kind = message["type"]
        if kind == "error":
            if message["code"] == "overloaded":
                tally.refused += 1
                return -1
            tally.errors[message["code"]] += 1
            return None
        if kind == "utterance.done" and message["utterance_id"] == uid:
            tally.utterances += 1
            tally.audio_s += message["duration_ms"] / 1000
            return int(message["duration_ms"])
        if kind == "utterance.interrupted" and message["utterance_id"] == uid:
            tally.interrupted += 1
            return got * 1000 // 24000


async def run(url: str, sessions: int, seconds: float, seed: int) -> dict[str, Any]:
    http = url.replace("ws://", "http://").rsplit("/v1/", 1)[0]
    idle = scrape(http)
    tally = Tally()
    rng = random.Random(seed)
    started = time.monotonic()
    stop_at = started + seconds
    tasks = [asyncio.create_task(session(url, i, stop_at, tally, random.Random(rng.random())))
             for i in range(sessions)]
    await asyncio.sleep(min(60.0, seconds / 4))
    warm = scrape(http)
    warm_at = time.monotonic() - started
    while time.monotonic() < stop_at - 2:
        await asyncio.sleep(min(10.0, stop_at - 2 - time.monotonic()))
        print(f"{time.monotonic() - started:6.0f} s  utterances {tally.utterances}  errors {sum(tally.errors.values())}"
              f"  {scrape(http)}", flush=True)
    end = scrape(http)
    await asyncio.gather(*tasks)
    await asyncio.sleep(2.0)
    after = scrape(http)
    ttfa = sorted(tally.ttfa)
    rss_drift = (end["process_resident_memory_bytes"] - warm["process_resident_memory_bytes"]) / max(
        1.0, warm["process_resident_memory_bytes"])
    return {
        "sessions": sessions,
        "seconds": seconds,
        "utterances_done": tally.utterances,
        "utterances_interrupted": tally.interrupted,
        "audio_seconds": round(tally.audio_s, 1),
        "packets": tally.packets,
        "errors": sum(tally.errors.values()),
        "errors_by_kind": dict(tally.errors),
        "refused_overloaded_then_retried": tally.refused,
        "ttfa_ms": {"p50": round(ttfa[len(ttfa) // 2] * 1000, 1) if ttfa else None,
                    "p99": round(ttfa[int(len(ttfa) * 0.99)] * 1000, 1) if ttfa else None},
        "server": {"idle": idle, f"warm_{warm_at:.0f}s": warm, "end": end, "after_clients_left": after},
        "rss_drift_warm_to_end": round(rss_drift, 4),
        "leaks_after_clients_left": {
            "tasks": after.get("cadence_event_loop_tasks", 0) - idle.get("cadence_event_loop_tasks", 0),
            "fds": after.get("process_open_fds", 0) - idle.get("process_open_fds", 0),
            "sessions": after.get("cadence_active_sessions", 0),
            "utterances": after.get("cadence_active_utterances", 0),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("deploy/bench/soak.json"))
    args = parser.parse_args(argv)
    record = run_record(argv)
    # the engine admits every session's utterance (its default, 256 + 64 queued, refuses the rest)
    with gateway_process("espeak", max_streams=args.sessions, queue_limit=args.sessions) as url:
        record.update(asyncio.run(run(url, args.sessions, args.minutes * 60, args.seed)))
    print(json.dumps(record, indent=1))
    write_json(args.out, record)
    return 0 if record["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
