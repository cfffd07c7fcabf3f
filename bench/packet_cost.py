"""The gateway's Python cost per packet, without sockets: sessions, their protocol, packetiser,
queue and pump, each session's frame writer a stub that takes the bytes.

`--streams` sessions each open one utterance on a stand-in engine whose streams are listened to
(engine.api.listen). A round hands every stream one chunk of `--chunk-ms` through its listener,
as an engine step does, then lets the event loop run its pass (the Pacer pumps every session).
The CPU time of the rounds over the packets written is the cost per packet; the best of
`--repeat` runs is reported (other work on the machine only adds to it). `--dtype int16` hands
int16 PCM, as the engine workers do; `float32` is what an engine in the gateway's process hands.

    .venv/bin/python -m bench.packet_cost --streams 200 --chunk-ms 20 --dtype float32
    .venv/bin/python -m bench.packet_cost --streams 200 --chunk-ms 80 --dtype int16 --encoding mulaw
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import run_record, write_json
from engine.api import AudioChunk, ChunkListener, EngineInfo, SynthesisRequest, TextSegment, pcm16
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.session import FRAME_WRITER, Session

RATE = 24_000


class _Writer:
    """gateway.session.FrameWriter that counts the packets it is given."""

    open = True
    writable = True

    def __init__(self) -> None:
        self.packets = 0

    async def wait_writable(self) -> None:
        pass

    def write(self, messages: Iterable[bytes | str]) -> None:
        self.packets += sum(isinstance(m, bytes) for m in messages)


class _Socket:
    def __init__(self, writer: _Writer) -> None:
        self.scope = {"extensions": {FRAME_WRITER: writer}}
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.application_state = None

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send_text(self, text: str) -> None:
        pass

    async def send_bytes(self, data: bytes) -> None:
        pass


class _Stream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.listener: ChunkListener | None = None

    def listen(self, listener: ChunkListener) -> bool:
        self.listener = listener
        return True

    def push(self, segment: TextSegment) -> None:
        pass

    def close_text(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _Engine:
    """Streams that make nothing by themselves: the rounds hand them their chunks."""

    info = EngineInfo("probe", "tone", RATE)

    def __init__(self) -> None:
        self.streams: list[_Stream] = []

    def open(self, request: SynthesisRequest) -> _Stream:
        stream = _Stream(request.request_id)
        self.streams.append(stream)
        return stream


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    engine, metrics = _Engine(), GatewayMetrics()
    writers: list[_Writer] = []
    tasks: list[asyncio.Task[None]] = []
    output = {"encoding": args.encoding, "sample_rate": args.sample_rate}
    for _ in range(args.streams):
        writer = _Writer()
        socket = _Socket(writer)
        writers.append(writer)
        session = Session(socket, engine, GatewayConfig(), metrics)  # type: ignore[arg-type]
        tasks.append(asyncio.create_task(session.run()))
        for message in (
            {"type": "session.start", "pacing": "asap", "timestamps": "none", "output": output},
            {"type": "speak.append", "utterance_id": "u", "text": "Hello there."},
        ):
            socket.inbox.put_nowait({"type": "websocket.receive", "text": json.dumps(message)})
    for _ in range(20):
        await asyncio.sleep(0)
    if len(engine.streams) != args.streams:
        raise SystemExit(f"{len(engine.streams)} of {args.streams} utterances opened")
    samples = RATE * args.chunk_ms // 1000
    tone: Any = (0.1 * np.sin(2 * np.pi * 200 * np.arange(samples) / RATE)).astype(np.float32)
    if args.dtype == "int16":
        tone = pcm16(tone)
    offset, runs = 0, []
    for _ in range(args.repeat):
        packets_before, cpu_before = sum(w.packets for w in writers), time.process_time()
        for _ in range(args.rounds):
            for stream in engine.streams:
                assert stream.listener is not None
                stream.listener.chunk(AudioChunk(stream.request_id, tone, offset))
            offset += samples
            await asyncio.sleep(0)  # the Pacer's pass
            await asyncio.sleep(0)
        cpu = time.process_time() - cpu_before
        runs.append(cpu / (sum(w.packets for w in writers) - packets_before) * 1e6)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"us_per_packet": round(min(runs), 2), "runs_us_per_packet": [round(r, 2) for r in runs]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--chunk-ms", type=int, default=20, help="audio per engine chunk")
    parser.add_argument("--dtype", choices=("float32", "int16"), default="float32")
    parser.add_argument("--encoding", default="pcm_s16le")
    parser.add_argument("--sample-rate", type=int, default=None, help="output rate (mulaw/alaw: 8000)")
    parser.add_argument("--rounds", type=int, default=100, help="chunks per stream in one run")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.sample_rate is None:
        args.sample_rate = 8000 if args.encoding in ("mulaw", "alaw") else RATE
    result = asyncio.run(measure(args))
    print(json.dumps({"streams": args.streams, "chunk_ms": args.chunk_ms, "dtype": args.dtype, **result}))
    if args.output is not None:
        write_json(args.output, {"run": run_record(argv), "result": result})


if __name__ == "__main__":
    main()
