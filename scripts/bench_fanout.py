"""Gateway fan-out with the null engine: how many real-time streams keep p99 packet lag < 10 ms?

Starts the real gateway (uvicorn, /v1/stream) with the null engine in a child process, then, for
each count N, opens N sessions (pacing "realtime"), each speaking a text of `--seconds` of audio,
and measures at the client every packet's lag: its arrival time minus when it was due, where a
stream's packets are due at (its earliest arrival relative to the audio timeline) + sample_offset /
rate. The ramp stops at the first N whose p99 lag reaches the limit. The client here is lean on
purpose (raw websockets, no event objects): on a small machine it shares the CPU with the gateway.

    .venv/bin/python -m scripts.bench_fanout --counts 25,50,100,200,400,800 -o deploy/bench/fanout-null.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import websockets

from scripts.bench_common import gateway_process, run_record, write_json

HEADER = struct.Struct("<BBHII")
CHARS_PER_S = 14.0  # the null engine's English speaking rate


async def one_stream(
    url: str, text: str, start_delay: float, skip_samples: int, pacing: str
) -> tuple[list[float], str | None]:
    """Relative arrival times (s) minus due times of one stream's packets; and an error, if any."""
    await asyncio.sleep(start_delay)
    points: list[tuple[float, int]] = []
    error: str | None = None
    rate = 24_000
    async with websockets.connect(url, max_size=None, compression=None, open_timeout=60) as ws:
        await ws.send(json.dumps({"type": "session.start", "pacing": pacing, "timestamps": "word"}))
        await ws.send(json.dumps({"type": "speak.append", "utterance_id": "u", "text": text}))
        await ws.send(json.dumps({"type": "speak.end", "utterance_id": "u"}))
        async for frame in ws:
            now = time.perf_counter()
            if isinstance(frame, bytes):
                offset = HEADER.unpack_from(frame)[4]
                points.append((now, offset))
                continue
            message = json.loads(frame)
            kind = message.get("type")
            if kind == "session.started":
                rate = int(message["output"]["sample_rate"])
            elif kind == "error":
                error = str(message.get("code"))
                break
            elif kind in ("utterance.done", "utterance.interrupted"):
                break
        await ws.send(json.dumps({"type": "session.end"}))
    if not points:
        return [], error or "no audio"
    lateness = np.array([t - offset / rate for t, offset in points])
    lag = lateness - lateness.min()
    keep = np.array([offset >= skip_samples for _, offset in points])
    return list(lag[keep]), error


async def timer_jitter_ms(seconds: float = 3.0) -> dict[str, float]:
    """The machine's noise floor: how late a plain 20 ms asyncio timer fires in this process."""
    loop = asyncio.get_running_loop()
    late: list[float] = []
    due = loop.time()
    end = due + seconds
    while due < end:
        due += 0.02
        await asyncio.sleep(max(0.0, due - loop.time()))
        late.append((loop.time() - due) * 1000.0)
    values = np.array(late)
    return {
        "p50": round(float(np.percentile(values, 50)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
    }


async def one_level(url: str, streams: int, seconds: float, ramp_s: float, pacing: str) -> dict[str, Any]:
    text = ("word " * int(seconds * CHARS_PER_S / 5 + 1)).strip()
    began = time.perf_counter()
    results = await asyncio.gather(
        *(
            one_stream(url, text, ramp_s * i / streams, skip_samples=int(0.5 * 24_000), pacing=pacing)
            for i in range(streams)
        ),
        return_exceptions=True,
    )
    lags: list[float] = []
    errors = 0
    for result in results:
        if isinstance(result, BaseException):
            errors += 1
            continue
        stream_lags, error = result
        lags.extend(stream_lags)
        errors += error is not None
    ms = np.array(lags) * 1000.0 if lags else np.array([np.nan])
    return {
        "streams": streams,
        "packets": len(lags),
        "errors": errors,
        "lag_p50_ms": round(float(np.percentile(ms, 50)), 2),
        "lag_p90_ms": round(float(np.percentile(ms, 90)), 2),
        "lag_p99_ms": round(float(np.percentile(ms, 99)), 2),
        "lag_max_ms": round(float(np.max(ms)), 2),
        "wall_s": round(time.perf_counter() - began, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="25,50,100,200,400,800,1200,1600")
    parser.add_argument("--seconds", type=float, default=6.0, help="audio per stream")
    parser.add_argument("--ramp-seconds", type=float, default=1.0, help="spread the stream starts over this")
    parser.add_argument("--pacing", choices=("realtime", "asap"), default="realtime")
    parser.add_argument("--limit-ms", type=float, default=10.0, help="p99 lag limit")
    parser.add_argument(
        "--keep-going", action="store_true", help="do not stop at the first count over the limit"
    )
    parser.add_argument("-o", "--output", type=Path, default=Path("deploy/bench/fanout-null.json"))
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    record = run_record(argv)
    record.update(
        {
            "engine": "null",
            "pacing": args.pacing,
            "seconds_per_stream": args.seconds,
            "limit_p99_lag_ms": args.limit_ms,
            "levels": [],
        }
    )
    record["timer_lateness_ms"] = asyncio.run(timer_jitter_ms())
    print(f"noise floor: a 20 ms asyncio timer fires late by {record['timer_lateness_ms']} ms (p50, p99)")
    with gateway_process("null") as url:
        for streams in counts:
            level = asyncio.run(one_level(url, streams, args.seconds, args.ramp_seconds, args.pacing))
            record["levels"].append(level)
            print(json.dumps(level))
            if level["lag_p99_ms"] >= args.limit_ms or level["errors"]:
                if not args.keep_going:
                    break
    passing = [
        lv["streams"] for lv in record["levels"] if lv["lag_p99_ms"] < args.limit_ms and not lv["errors"]
    ]
    record["max_streams_p99_lag_under_limit"] = max(passing, default=0)
    write_json(args.output, record)
    print(
        f"largest stream count with p99 packet lag < {args.limit_ms} ms: {record['max_streams_p99_lag_under_limit']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
