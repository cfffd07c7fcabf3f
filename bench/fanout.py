"""Gateway fan-out with the null engine: how many real-time streams keep p99 packet lag < 10 ms?

Starts the real gateway (uvicorn, /v1/stream) with the null engine in a child process, then, for
each count N, opens N sessions (pacing "realtime"), each speaking a text of `--seconds` of audio,
and measures at the client every packet's lag: its arrival time minus when it was due, where a
stream's packets are due at (its earliest arrival relative to the audio timeline) + sample_offset /
rate. The ramp stops at the first N whose p99 lag reaches the limit (unless --keep-going).

The clients run in `--client-procs` processes of their own and, by default, speak WebSocket over
raw asyncio sockets (one timestamp per socket read, no per-frame objects), so that on a small
machine the client costs little of the CPU it shares with the gateway; `--client websockets` uses
the websockets library instead. Each level records the gateway process's CPU use (% of one core).
`--repeat` runs every level several times and reports the median p99.

The null engine puts every stream on one 20 ms grid (`--null-phase shared`): all streams' packets
of a tick come in one burst, and a stream's lag moves with its place in it (the worst case).
`--null-phase stream` starts each stream's clock when its text comes instead, so the streams'
packets are spread over the 20 ms like those of independent real-time sources.

`--null-speed 2 --null-chunk-ms 80` runs the engine ahead of real time, as a real one runs (80 ms
codec frames at RTF 0.5): the gateway's realtime pacing then releases the audio, `realtime_lead_ms`
ahead of the stream's clock, and a packet's lag is taken against a player's clock started by the
stream's first packet (`--lag playout`): how late past the moment it must be played it came.

    .venv/bin/python -m bench.fanout --counts 25,50,100,200,400,800 -o deploy/bench/fanout-null.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import struct
import time
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import websockets

from bench.common import cpu_times, gateway_child, run_record, write_json

HEADER = struct.Struct("<BBHII")
OFFSET = struct.Struct("<I")  # sample_offset, at byte 8 of a packet
CHARS_PER_S = 14.0  # the null engine's English speaking rate
RATE = 24_000
Lags = tuple[list[float], float | None, str | None]  # packet lags, first audio (s from connecting), error


def session_messages(text: str, pacing: str) -> list[str]:
    return [
        json.dumps({"type": "session.start", "pacing": pacing, "timestamps": "word"}),
        json.dumps({"type": "speak.append", "utterance_id": "u", "text": text}),
        json.dumps({"type": "speak.end", "utterance_id": "u"}),
    ]


def lags_of(
    times: list[float], offsets: list[int], rate: int, skip_samples: int, lag: str = "jitter"
) -> list[float]:
    """Each packet's arrival minus its due time. "jitter": the stream's earliest packet (the one
    least late) counts as on time, so any unevenness shows; "playout": a packet is due when a
    player that started at the first packet's arrival plays it (negative: it came ahead)."""
    if not times:
        return []
    lateness = np.asarray(times) - np.asarray(offsets, dtype=np.float64) / rate
    late = lateness - (lateness[0] if lag == "playout" else lateness.min())
    return list(late[np.asarray(offsets) >= skip_samples])


# -- the lean client: WebSocket over a raw asyncio socket --------------------------------------


def client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (a zero mask key: valid, and the bytes stay as they are)."""
    size = len(payload)
    if size < 126:
        head = bytes((0x80 | opcode, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + size.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


class RawStream(asyncio.Protocol):
    """One session: upgrade, send the messages, note (arrival time, sample offset) of each packet."""

    def __init__(self, host: str, path: str, messages: list[str]) -> None:
        self.request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        self.messages = messages
        self.buffer = bytearray()
        self.upgraded = False
        self.times: list[float] = []
        self.offsets: list[int] = []
        self.rate = RATE
        self.error: str | None = None
        self.finished = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(None if self.times else "connection lost")

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buffer += data
        if not self.upgraded:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            if b" 101 " not in self.buffer[: self.buffer.find(b"\r\n")]:
                self._close("upgrade refused")
                return
            del self.buffer[: end + 4]
            self.upgraded = True
            self._write(b"".join(client_frame(1, m.encode()) for m in self.messages))
        self._parse(now)

    def _parse(self, now: float) -> None:
        buf, pos, end = self.buffer, 0, len(self.buffer)
        while end - pos >= 2:
            opcode, size, head = buf[pos] & 0x0F, buf[pos + 1] & 0x7F, 2
            if size == 126:
                if end - pos < 4:
                    break
                size, head = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 4
            elif size == 127:
                if end - pos < 10:
                    break
                size, head = int.from_bytes(buf[pos + 2 : pos + 10], "big"), 10
            start = pos + head
            if end - start < size:
                break
            pos = start + size
            if opcode == 2:
                self.times.append(now)
                self.offsets.append(OFFSET.unpack_from(buf, start + 8)[0])
            elif opcode == 1:
                self._on_message(json.loads(bytes(buf[start:pos])))
            elif opcode == 9:  # ping
                self._write(client_frame(10, bytes(buf[start:pos])))
            elif opcode == 8:
                self._close(None if self.times else "closed by the server")
        del buf[:pos]

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "session.started":
            self.rate = int(message["output"]["sample_rate"])
        elif kind == "error":
            self.error = self.error or str(message.get("code"))
            self._close(self.error)
        elif kind in ("utterance.done", "utterance.interrupted"):
            self._write(client_frame(1, b'{"type":"session.end"}'))
            self._close(None)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close(self, error: str | None) -> None:
        self._write(client_frame(8, (1000).to_bytes(2, "big")))
        if self.transport is not None:
            self.transport.close()
        self._finish(error)

    def _finish(self, error: str | None) -> None:
        if not self.finished.done():
            self.finished.set_result(self.error or error)


async def raw_stream(
    url: str, text: str, start_delay: float, skip_samples: int, pacing: str, lag: str
) -> Lags:
    await asyncio.sleep(start_delay)
    began = time.perf_counter()
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    _, stream = await loop.create_connection(
        lambda: RawStream(f"{host}:{port}", parts.path, session_messages(text, pacing)), host, port
    )
    try:
        error = await asyncio.wait_for(stream.finished, 120)
    except TimeoutError:
        error = "timed out"
        stream._close(error)
    if not stream.times:
        return [], None, error or "no audio"
    return (
        lags_of(stream.times, stream.offsets, stream.rate, skip_samples, lag),
        stream.times[0] - began,
        error,
    )


# -- the reference client: the websockets library ----------------------------------------------


async def websockets_stream(
    url: str, text: str, start_delay: float, skip_samples: int, pacing: str, lag: str
) -> Lags:
    await asyncio.sleep(start_delay)
    began = time.perf_counter()
    times: list[float] = []
    offsets: list[int] = []
    error: str | None = None
    rate = RATE
    async with websockets.connect(url, max_size=None, compression=None, open_timeout=60) as ws:
        for message in session_messages(text, pacing):
            await ws.send(message)
        async for frame in ws:
            now = time.perf_counter()
            if isinstance(frame, bytes):
                times.append(now)
                offsets.append(HEADER.unpack_from(frame)[4])
                continue
            event = json.loads(frame)
            kind = event.get("type")
            if kind == "session.started":
                rate = int(event["output"]["sample_rate"])
            elif kind == "error":
                error = str(event.get("code"))
                break
            elif kind in ("utterance.done", "utterance.interrupted"):
                break
        await ws.send(json.dumps({"type": "session.end"}))
    if not times:
        return [], None, error or "no audio"
    return lags_of(times, offsets, rate, skip_samples, lag), times[0] - began, error


# -- one level ----------------------------------------------------------------------------------


def client_share(
    url: str, client: str, text: str, delays: list[float], start_at: float, pacing: str, lag: str
) -> tuple[list[float], list[float], int, float]:
    """One client process's streams: (their lags, their first audio, errors, the process's CPU seconds)."""
    stream = raw_stream if client == "raw" else websockets_stream
    cpu0 = time.process_time()

    async def run() -> list[Lags | BaseException]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await asyncio.gather(
            *(stream(url, text, delay, int(0.5 * RATE), pacing, lag) for delay in delays),
            return_exceptions=True,
        )

    try:  # the client's own loop costs less CPU on uvloop, which the gateway then has
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        results = runner.run(run())
    lags: list[float] = []
    firsts: list[float] = []
    errors = 0
    for result in results:
        if isinstance(result, BaseException):
            errors += 1
            continue
        lags.extend(result[0])
        if result[1] is not None:
            firsts.append(result[1])
        errors += result[2] is not None
    return lags, firsts, errors, time.process_time() - cpu0


def one_level(
    pool: Any, url: str, gateway_pid: int, streams: int, args: argparse.Namespace
) -> dict[str, Any]:
    text = ("word " * int(args.seconds * CHARS_PER_S / 5 + 1)).strip()
    delays = [args.ramp_seconds * i / streams for i in range(streams)]
    procs = args.client_procs
    start_at = time.time() + 0.5  # every client process starts its ramp at the same moment
    times0, began = cpu_times(gateway_pid), time.perf_counter()
    shares = pool.starmap(
        client_share,
        [(url, args.client, text, delays[i::procs], start_at, args.pacing, args.lag) for i in range(procs)],
    )
    wall = time.perf_counter() - began
    times1 = cpu_times(gateway_pid)
    cpu0, cpu1 = (None, None) if times0 is None or times1 is None else (sum(times0), sum(times1))
    system = None if times0 is None or times1 is None else times1[1] - times0[1]
    lags = [lag for share in shares for lag in share[0]]
    ms = np.array(lags) * 1000.0 if lags else np.array([np.nan])
    firsts = [first for share in shares for first in share[1]]
    first_ms = np.array(firsts) * 1000.0 if firsts else np.array([np.nan])
    gateway_cpu = None if cpu0 is None or cpu1 is None else round(100.0 * (cpu1 - cpu0) / (wall - 0.5), 1)
    return {
        "streams": streams,
        "packets": len(lags),
        "errors": sum(share[2] for share in shares),
        "lag_p50_ms": round(float(np.percentile(ms, 50)), 2),
        "lag_p90_ms": round(float(np.percentile(ms, 90)), 2),
        "lag_p99_ms": round(float(np.percentile(ms, 99)), 2),
        "lag_max_ms": round(float(np.max(ms)), 2),
        # from connecting to the first packet: a gateway that falls behind starts streams late
        "first_audio_p50_ms": round(float(np.percentile(first_ms, 50)), 1),
        "first_audio_p99_ms": round(float(np.percentile(first_ms, 99)), 1),
        "gateway_cpu_pct": gateway_cpu,  # % of one core over the level (ramp and tail included)
        # the gateway's CPU time per packet delivered (sessions' set-up included): less skewed by
        # other work on the machine than the lag is
        "gateway_cpu_us_per_packet": None
        if cpu0 is None or cpu1 is None or not lags
        else round(1e6 * (cpu1 - cpu0) / len(lags), 1),
        "gateway_system_share": None
        if system is None or not cpu1 or cpu1 == cpu0
        else round(system / (cpu1 - cpu0), 2),
        "client_cpu_pct": round(100.0 * sum(share[3] for share in shares) / (wall - 0.5), 1),
        "wall_s": round(wall - 0.5, 2),
    }


def passes(level: dict[str, Any], args: argparse.Namespace) -> bool:
    """Sustained: p99 lag under the limit, every stream started promptly, no errors."""
    return bool(
        level["lag_p99_ms"] < args.limit_ms
        and level["first_audio_p99_ms"] < args.first_audio_limit_ms
        and not level["errors"]
    )


def median_level(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median p99 lag stands for the level, with the median p99 first audio of
    the runs (the two need not come from one run); every run's figures are kept."""
    ranked = sorted(runs, key=lambda r: r["lag_p99_ms"])
    level = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        firsts = sorted(r["first_audio_p99_ms"] for r in runs)
        level["first_audio_p99_ms"] = firsts[(len(firsts) - 1) // 2]
        level["runs_lag_p99_ms"] = [r["lag_p99_ms"] for r in runs]
        level["runs_first_audio_p99_ms"] = [r["first_audio_p99_ms"] for r in runs]
        level["runs_gateway_cpu_pct"] = [r["gateway_cpu_pct"] for r in runs]
        level["errors"] = max(r["errors"] for r in runs)
    return level


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--counts", default="25,50,100,200,400,800,1200,1600")
    parser.add_argument("--seconds", type=float, default=6.0, help="audio per stream")
    parser.add_argument("--ramp-seconds", type=float, default=1.0, help="spread the stream starts over this")
    parser.add_argument("--pacing", choices=("realtime", "asap"), default="realtime")
    parser.add_argument(
        "--null-phase",
        choices=("shared", "stream"),
        default="shared",
        help="all streams on one 20 ms grid, or each on its own clock",
    )
    parser.add_argument("--null-chunk-ms", type=int, default=20, help="audio per null-engine chunk")
    parser.add_argument(
        "--null-speed",
        type=float,
        default=1.0,
        help="the null engine's speed, a multiple of real time (>1: it runs ahead and the gateway paces)",
    )
    parser.add_argument(
        "--lag",
        choices=("jitter", "playout"),
        default=None,
        help="lag against the stream's least-late packet (jitter) or a player's clock started "
        "by the first packet (playout); default: jitter at speed 1, playout above",
    )
    parser.add_argument("--limit-ms", type=float, default=10.0, help="p99 lag limit")
    parser.add_argument(
        "--first-audio-limit-ms",
        type=float,
        default=100.0,
        help="p99 limit on first audio (from connecting): a level whose streams start late fails",
    )
    parser.add_argument("--client", choices=("raw", "websockets"), default="raw")
    parser.add_argument("--client-procs", type=int, default=1, help="client processes (not the gateway's)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per level; the median p99 is reported")
    parser.add_argument(
        "--keep-going", action="store_true", help="do not stop at the first count over the limit"
    )
    parser.add_argument("-o", "--output", type=Path, default=Path("deploy/bench/fanout-null.json"))
    args = parser.parse_args(argv)
    if args.lag is None:
        args.lag = "jitter" if args.null_speed <= 1.0 else "playout"
    counts = [int(c) for c in args.counts.split(",")]
    record = run_record(argv)
    record.update(
        {
            "engine": "null",
            "pacing": args.pacing,
            "null_phase": args.null_phase,
            "null_chunk_ms": args.null_chunk_ms,
            "null_speed": args.null_speed,
            "lag": args.lag,
            "seconds_per_stream": args.seconds,
            "limit_p99_lag_ms": args.limit_ms,
            "limit_p99_first_audio_ms": args.first_audio_limit_ms,
            "client": args.client,
            "client_procs": args.client_procs,
            "repeat": args.repeat,
            "levels": [],
        }
    )
    record["timer_lateness_ms"] = asyncio.run(timer_jitter_ms())
    print(f"noise floor: a 20 ms asyncio timer fires late by {record['timer_lateness_ms']} ms (p50, p99)")
    engine_options = {"phase": args.null_phase, "chunk_ms": args.null_chunk_ms, "speed": args.null_speed}
    with (
        gateway_child("null", **engine_options) as gateway,
        mp.get_context("spawn").Pool(args.client_procs) as pool,
    ):
        for streams in counts:
            runs = []
            for _ in range(args.repeat):
                runs.append(one_level(pool, gateway.url, gateway.pid, streams, args))
                print(json.dumps(runs[-1]), flush=True)
            level = median_level(runs)
            record["levels"].append(level)
            if not passes(level, args) and not args.keep_going:
                break
    passing = [lv["streams"] for lv in record["levels"] if passes(lv, args)]
    record["max_streams_p99_lag_under_limit"] = max(passing, default=0)
    write_json(args.output, record)
    print(
        f"largest stream count with p99 packet lag < {args.limit_ms} ms ({args.lag}) and p99 first audio < "
        f"{args.first_audio_limit_ms} ms: {record['max_streams_p99_lag_under_limit']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
