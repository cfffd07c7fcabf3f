"""The machine's floor for fan-out: a bare writer, no gateway, measured by the fan-out bench's client.

A child process accepts WebSocket upgrades (no checks, no parsing of what the client sends) and,
on one shared 20 ms grid, writes every connection its next packets: prebuilt frames, only the
12-byte header filled in, `--per-write` packets in one transport write every `--per-write` x 20 ms.
What it costs per packet is the least any Python process on uvloop can pay here (the kernel's
loopback send is most of it), so it bounds what the gateway can reach on the same machine.

    .venv/bin/python -m bench.fanout_floor --counts 100,200,400,800 --per-write 1
    .venv/bin/python -m bench.fanout_floor --counts 400,800,1200,1600 --per-write 2 --lag playout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import struct
import time
from pathlib import Path
from typing import Any

from bench.common import free_port, run_record, write_json
from bench.fanout import one_level, timer_jitter_ms

TICK_S = 0.02
_HEADER = struct.Struct("<BBHII")  # version, flags, stream, seq, sample_offset
_BINARY_972 = b"\x82\x7e\x03\xcc"  # a binary frame of 12 + 960 bytes
_PAYLOAD = bytes(960)  # 20 ms of silence, pcm_s16le at 24 kHz
_DONE = json.dumps({"type": "utterance.done", "utterance_id": "u"}).encode()


class _Connection(asyncio.Protocol):
    def __init__(self, writer: _Writer) -> None:
        self.writer = writer
        self.head = b""
        self.seq = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport

    def data_received(self, data: bytes) -> None:
        if self.head is None:
            return  # the client's messages: not read
        self.head += data
        if b"\r\n\r\n" in self.head:
            self.head = None  # type: ignore[assignment]
            self.transport.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\nSec-WebSocket-Accept: -\r\n\r\n"
            )
            self.writer.live[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.writer.live.pop(self, None)

    def send(self, count: int, packets: int) -> bool:
        """The next `count` packets in one write; False after the last."""
        seq = self.seq
        end = min(seq + count, packets)
        frames = [_BINARY_972 + _HEADER.pack(1, 0, 1, s, s * 480) + _PAYLOAD for s in range(seq, end)]
        self.seq = end
        if end >= packets:
            frames.append(bytes((0x81, len(_DONE))) + _DONE)
        self.transport.write(b"".join(frames))
        return end < packets


class _Writer:
    def __init__(self, per_write: int, packets: int) -> None:
        self.per_write = per_write
        self.packets = packets
        self.live: dict[_Connection, None] = {}

    def tick(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        for connection in list(self.live):
            if not connection.send(self.per_write, self.packets):
                self.live.pop(connection, None)
        loop.call_at(at + TICK_S * self.per_write, self.tick, loop, at + TICK_S * self.per_write)


def _serve(port: int, per_write: int, packets: int, ready: Any) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        writer = _Writer(per_write, packets)
        await loop.create_server(lambda: _Connection(writer), "127.0.0.1", port, backlog=4096)
        start = loop.time() + TICK_S
        loop.call_at(start, writer.tick, loop, start)
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--counts", default="100,200,400,800")
    parser.add_argument("--seconds", type=float, default=5.0, help="audio per stream")
    parser.add_argument("--per-write", type=int, default=1, help="20 ms packets per write (and per tick)")
    parser.add_argument("--lag", choices=("jitter", "playout"), default="jitter")
    parser.add_argument("--ramp-seconds", type=float, default=1.0)
    parser.add_argument("-o", "--output", type=Path, default=Path("deploy/bench/fanout-floor.json"))
    args = parser.parse_args(argv)
    args.client, args.client_procs, args.pacing = "raw", 1, "realtime"  # what one_level reads
    record = run_record(argv)
    record.update(
        {
            "server": "bare uvloop writer",
            "per_write": args.per_write,
            "lag": args.lag,
            "seconds_per_stream": args.seconds,
            "levels": [],
        }
    )
    record["timer_lateness_ms"] = asyncio.run(timer_jitter_ms())
    context = mp.get_context("spawn")
    port, ready = free_port(), context.Event()
    server = context.Process(
        target=_serve, args=(port, args.per_write, int(args.seconds / TICK_S), ready), daemon=True
    )
    server.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the bare writer did not start")
        assert server.pid is not None
        with context.Pool(1) as pool:
            for streams in (int(c) for c in args.counts.split(",")):
                level = one_level(pool, f"ws://127.0.0.1:{port}/v1/stream", server.pid, streams, args)
                record["levels"].append(level)
                print(json.dumps(level), flush=True)
                time.sleep(0.5)
    finally:
        server.terminate()
        server.join(10)
    write_json(args.output, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
