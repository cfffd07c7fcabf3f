"""Soak: many concurrent /v1/stream sessions against the real gateway (eSpeak) for minutes.

Each session loops: one utterance (a sentence, 100 ms packets), read to `utterance.done`, "play"
it (sleep its duration), pause 0.5-2 s; every tenth utterance is cut by a `speak.cancel` half way.
Sessions start spread over the first `--ramp-s` (20 s). The gateway's own /metrics give RSS, open file
descriptors and live asyncio tasks: before any client, after warm-up (`--warmup-s`, the memory
baseline), every 10 s, at the end with every session still open, and after all have left.
Errors: `error` messages, unexpected closes (with the close code and reason the server sent),
utterances that never finish (30 s), malformed packets; each is listed with its session,
utterance and time. The load average is sampled too: other work on the machine shows there.

    python -m bench.soak --sessions 500 --minutes 10 --out deploy/bench/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import websockets

from bench.common import gateway_process, run_record, write_json
from gateway.config import GatewayConfig
from gateway.messages import unpack_packet

SENTENCES = [
    "Thank you for calling, how can I help you today?",
    "Your order has shipped and should arrive on Thursday.",
    "I have booked a table for two at seven thirty.",
    "The weather tomorrow will be sunny with a light breeze.",
    "Please hold while I transfer you to the right department.",
    "请帮我订一台 iPhone 15，谢谢。",
]
WATCHED = (
    "process_resident_memory_bytes",
    "process_open_fds",
    "cadence_event_loop_tasks",
    "cadence_active_sessions",
    "cadence_active_utterances",
    "cadence_session_queue_bytes",
    "process_cpu_seconds_total",
    'cadence_engine_figure{name="x_realtime"}',
    "cadence_engine_queue_depth",
    'cadence_errors_total{code="slow_client"}',
)
ERRORS_LISTED = 200
RSS = "process_resident_memory_bytes"


def scrape(http: str) -> dict[str, float]:
    """The watched gauges, and `scrape_s`: how long /metrics took (the gateway's event-loop lag
    shows there). Empty when the gateway did not answer within 60 s."""
    began = time.monotonic()
    try:
        with urllib.request.urlopen(f"{http}/metrics", timeout=60) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {"scrape_s": round(time.monotonic() - began, 2)}
    for name in WATCHED:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
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
        self.started = time.monotonic()
        self.details: list[dict[str, Any]] = []  # the first ERRORS_LISTED errors, one line each
        self.finished: Counter[int] = Counter()  # per session: utterances done or interrupted

    def history_entries(self) -> int:
        """Finished utterances the gateway still remembers (at most `history_size` per session):
        a bounded cache that fills as sessions age, so part of any RSS growth by design."""
        size = GatewayConfig().history_size
        return sum(min(size, n) for n in self.finished.values())

    def error(self, kind: str, session: int, utterance: int, **detail: Any) -> None:
        self.errors[kind] += 1
        if len(self.details) < ERRORS_LISTED:
            self.details.append(
                {
                    "kind": kind,
                    "session": session,
                    "utterance": utterance,
                    "at_s": round(time.monotonic() - self.started, 1),
                    **detail,
                }
            )


async def session(
    url: str, index: int, stop_at: float, tally: Tally, rng: random.Random, ramp_s: float
) -> None:
    await asyncio.sleep(rng.uniform(0, ramp_s))
    n = 0
    phase = "connect"
    try:
        async with websockets.connect(url, max_size=None, open_timeout=30, ping_interval=None) as ws:
            await ws.send(json.dumps({"type": "session.start", "output": {"packet_ms": 100}}))
            while time.monotonic() < stop_at:
                n += 1
                phase = "utterance"
                uid = f"u{n}"
                cut = n % 10 == 0
                sent = time.monotonic()
                await ws.send(
                    json.dumps({"type": "speak.append", "utterance_id": uid, "text": rng.choice(SENTENCES)})
                )
                await ws.send(json.dumps({"type": "speak.end", "utterance_id": uid}))
                duration = await _read_utterance(ws, uid, sent, cut, tally, index)
                if duration == -1:  # refused (overloaded): back off, then a new utterance
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    continue
                if duration is None:
                    return
                phase = "playing"
                await asyncio.sleep(duration / 1000 + rng.uniform(0.5, 2.0))
            phase = "ending"
            await ws.send(json.dumps({"type": "session.end"}))
            while True:
                frame = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(frame, str) and json.loads(frame)["type"] == "session.ended":
                    break
    except websockets.ConnectionClosedOK:
        pass
    except websockets.ConnectionClosed as exc:  # the close frame the server sent, if any
        close = exc.rcvd
        tally.error(
            type(exc).__name__,
            index,
            n,
            phase=phase,
            close_code=close.code if close else None,
            close_reason=close.reason if close else None,
            sent_close=bool(exc.sent),
        )
    except Exception as exc:  # a timeout, a refused connection
        tally.error(type(exc).__name__, index, n, phase=phase, message=str(exc)[:200])


async def _read_utterance(ws: Any, uid: str, sent: float, cut: bool, tally: Tally, index: int) -> int | None:
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
            tally.error(message["code"], index, int(uid[1:]), message=message.get("message", "")[:200])
            return None
        if kind == "utterance.done" and message["utterance_id"] == uid:
            tally.utterances += 1
            tally.finished[index] += 1
            tally.audio_s += message["duration_ms"] / 1000
            return int(message["duration_ms"])
        if kind == "utterance.interrupted" and message["utterance_id"] == uid:
            tally.interrupted += 1
            tally.finished[index] += 1
            return got * 1000 // 24000


async def run(
    url: str,
    sessions: int,
    seconds: float,
    seed: int,
    warmup_s: float,
    progress: Path | None,
    ramp_s: float = 20.0,
) -> dict[str, Any]:
    http = url.replace("ws://", "http://").rsplit("/v1/", 1)[0]
    idle = scrape(http)
    progress_file = progress.open("w") if progress else None
    tally = Tally()
    rng = random.Random(seed)
    started = time.monotonic()
    stop_at = started + seconds
    tasks = [
        asyncio.create_task(session(url, i, stop_at, tally, random.Random(rng.random()), ramp_s))
        for i in range(sessions)
    ]
    series: list[dict[str, float]] = []
    warm: dict[str, float] | None = None
    warm_at = 0.0
    warm_history = 0
    client_cpu0 = _cpu_s()
    while time.monotonic() < stop_at - 2:
        await asyncio.sleep(min(10.0, stop_at - 2 - time.monotonic()))
        now = await asyncio.to_thread(scrape, http)  # a slow answer must not stall the sessions
        at = time.monotonic() - started
        if warm is None and at >= min(warmup_s, seconds / 2) and now:
            warm, warm_at, warm_history = now, at, tally.history_entries()
        point = {
            "t_s": round(at),
            "utterances": tally.utterances,
            "errors": sum(tally.errors.values()),
            "rss_mb": round(now.get("process_resident_memory_bytes", 0) / 1e6, 1),
            "fds": now.get("process_open_fds", 0),
            "tasks": now.get("cadence_event_loop_tasks", 0),
            "server_cpu_s": round(now.get("process_cpu_seconds_total", 0), 1),
            "client_cpu_s": round(_cpu_s() - client_cpu0, 1),
            "load_1m": round(os.getloadavg()[0], 2),
            "scrape_s": now.get("scrape_s", -1.0),
        }
        series.append(point)
        line = "  ".join(f"{k} {v}" for k, v in point.items())
        print(line, flush=True)
        if progress_file:
            progress_file.write(line + "\n")
            progress_file.flush()
    end = await asyncio.to_thread(scrape, http)
    end_history = tally.history_entries()
    await asyncio.gather(*tasks)
    await asyncio.sleep(2.0)
    after: dict[str, float] = {}
    for _ in range(5):  # the gateway answers again once the clients have gone
        after = await asyncio.to_thread(scrape, http)
        if after:
            break
    if progress_file:
        progress_file.close()
    warm = warm or end
    ttfa = sorted(tally.ttfa)
    base = warm.get(RSS)
    after_warm = [p for p in series if p["t_s"] >= warm_at]
    rss_peak = max((p["rss_mb"] for p in after_warm), default=0.0)
    loads = [p["load_1m"] for p in series]
    return {
        "sessions": sessions,
        "seconds": seconds,
        "ramp_s": ramp_s,
        "memory_note": "drift is measured from the warm-up sample; history_entries counts finished "
        "utterances the gateway keeps by design (history_size per session)",
        "utterances_done": tally.utterances,
        "utterances_interrupted": tally.interrupted,
        "audio_seconds": round(tally.audio_s, 1),
        "packets": tally.packets,
        "errors": sum(tally.errors.values()),
        "errors_by_kind": dict(tally.errors),
        "error_details": tally.details,
        "refused_overloaded_then_retried": tally.refused,
        "ttfa_ms": {
            "p50": round(ttfa[len(ttfa) // 2] * 1000, 1) if ttfa else None,
            "p99": round(ttfa[int(len(ttfa) * 0.99)] * 1000, 1) if ttfa else None,
        },
        "server": {"idle": idle, f"warm_{warm_at:.0f}s": warm, "end": end, "after_clients_left": after},
        "memory_baseline_at_s": round(warm_at),
        "rss_drift_warm_to_end": _drift(end.get(RSS), base),
        "rss_drift_warm_to_peak": _drift(rss_peak * 1e6, base),
        "rss_after_clients_left_vs_warm": _drift(after.get(RSS), base),
        "load_average_1m_during": {
            "min": min(loads, default=0.0),
            "max": max(loads, default=0.0),
            "mean": round(sum(loads) / max(1, len(loads)), 2),
        },
        "history_entries": {"at_baseline": warm_history, "at_end": end_history},
        "series": series,
        "leaks_after_clients_left": {
            "tasks": after.get("cadence_event_loop_tasks", 0) - idle.get("cadence_event_loop_tasks", 0),
            "fds": after.get("process_open_fds", 0) - idle.get("process_open_fds", 0),
            "sessions": after.get("cadence_active_sessions", 0),
            "utterances": after.get("cadence_active_utterances", 0),
        },
    }


def _drift(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else round(value / base - 1, 4)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ramp-s", type=float, default=20.0, help="sessions start spread over this long")
    parser.add_argument("--warmup-s", type=float, default=120.0, help="memory baseline after this long")
    parser.add_argument("--out", type=Path, default=Path("deploy/bench/soak.json"))
    parser.add_argument("--progress", type=Path, default=None, help="also write the 10 s samples here")
    args = parser.parse_args(argv)
    record = run_record(argv)
    # every session's utterance is admitted or queued, never refused: the soak measures leaks, not capacity
    with gateway_process("espeak", max_streams=args.sessions, queue_limit=args.sessions) as url:
        record.update(
            asyncio.run(
                run(
                    url,
                    args.sessions,
                    args.minutes * 60,
                    args.seed,
                    args.warmup_s,
                    args.progress,
                    args.ramp_s,
                )
            )
        )
    print(json.dumps(record, indent=1))
    write_json(args.out, record)
    return 0 if record["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
