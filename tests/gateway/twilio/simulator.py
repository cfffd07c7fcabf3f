"""A Twilio Media Streams peer, written from Twilio's public protocol, for bidirectional streams.

It connects like Twilio does (`connected`, then `start` with the call's ids and custom parameters),
sends the caller's audio as inbound `media` (μ-law 8 kHz, 20 ms frames, in real time), and plays
what it receives like Twilio's buffer: outbound media is queued and played at real time, a `mark`
is echoed when all audio queued before it has played, and `clear` empties the buffer and echoes
every mark still in it (which is why such marks prove nothing). Everything is recorded with
timestamps on the simulator's clock.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from gateway.packets import mulaw_decode, mulaw_encode

RATE = 8000
FRAME = 160  # bytes (= samples) per 20 ms
FRAME_S = 0.02
SILENCE = bytes([0xFF]) * FRAME  # μ-law zero


def tone_frame(dbfs: float, frame_index: int, hz: float = 300.0) -> bytes:
    """20 ms of a sine at `dbfs` (RMS relative to full scale), phase-continuous over frames."""
    amplitude = 32768.0 * math.sqrt(2.0) * 10 ** (dbfs / 20.0)
    t = (np.arange(FRAME) + frame_index * FRAME) / RATE
    pcm = np.round(amplitude * np.sin(2 * math.pi * hz * t)).clip(-32768, 32767).astype(np.int16)
    return mulaw_encode(pcm).tobytes()


@dataclass
class Played:
    at: float
    audio: bytes


@dataclass
class Echo:
    at: float
    name: str
    after_clear: bool  # echoed because a clear flushed it, not because it played


@dataclass
class SimulatorLog:
    media_in: list[tuple[float, bytes]] = field(default_factory=list)  # outbound media as it arrived
    marks_in: list[tuple[float, str]] = field(default_factory=list)
    clears: list[float] = field(default_factory=list)
    played: list[Played] = field(default_factory=list)  # 20 ms frames that reached the caller's ear
    echoes: list[Echo] = field(default_factory=list)
    other: list[dict[str, Any]] = field(default_factory=list)
    first_audio_at: float | None = None

    def played_marks(self) -> list[str]:
        return [e.name for e in self.echoes if not e.after_clear]

    def heard_audio(self) -> bytes:
        return b"".join(p.audio for p in self.played)


class TwilioSimulator:
    def __init__(
        self,
        url: str,
        call_sid: str = "CA00000000000000000000000000000001",
        stream_sid: str = "MZ00000000000000000000000000000001",
        custom_parameters: dict[str, str] | None = None,
    ) -> None:
        self.url = url
        self.call_sid = call_sid
        self.stream_sid = stream_sid
        self.custom_parameters = custom_parameters or {}
        self.log = SimulatorLog()
        self.buffer: deque[bytes | str] = deque()  # audio bytes and mark names, in order
        self.caller_dbfs: float | None = None  # None: the caller is silent
        self._ws: ClientConnection | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sequence = 0
        self._loop = asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop.time()

    async def __aenter__(self) -> TwilioSimulator:
        self._ws = await websockets.connect(self.url, max_size=None, compression=None)
        await self._send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self._send(
            {
                "event": "start",
                "streamSid": self.stream_sid,
                "start": {
                    "accountSid": "AC00000000000000000000000000000001",
                    "streamSid": self.stream_sid,
                    "callSid": self.call_sid,
                    "tracks": ["inbound"],
                    "customParameters": self.custom_parameters,
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1},
                },
            }
        )
        self._tasks = [self._loop.create_task(t) for t in (self._receive(), self._play(), self._speak())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _send(self, message: dict[str, Any]) -> None:
        assert self._ws is not None
        self._sequence += 1
        if message["event"] != "connected":
            message = {**message, "sequenceNumber": str(self._sequence)}
        await self._ws.send(json.dumps(message))

    async def dtmf(self, digit: str) -> None:
        await self._send(
            {
                "event": "dtmf",
                "streamSid": self.stream_sid,
                "dtmf": {"track": "inbound_track", "digit": digit},
            }
        )

    async def stop(self) -> None:
        if self._ws is None:
            return
        with contextlib.suppress(websockets.ConnectionClosed):
            await self._send(
                {
                    "event": "stop",
                    "streamSid": self.stream_sid,
                    "stop": {"accountSid": "AC00000000000000000000000000000001", "callSid": self.call_sid},
                }
            )
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._ws.close()
        self._ws = None

    # -- outbound: Twilio's playback buffer -------------------------------------------------------
    async def _receive(self) -> None:
        assert self._ws is not None
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in self._ws:
                message = json.loads(frame)
                now = self.now()
                event = message.get("event")
                if event == "media":
                    audio = base64.b64decode(message["media"]["payload"])
                    self.log.media_in.append((now, audio))
                    self.buffer.append(audio)
                elif event == "mark":
                    name = message["mark"]["name"]
                    self.log.marks_in.append((now, name))
                    self.buffer.append(name)
                    await self._echo_ready_marks(now)
                elif event == "clear":
                    self.log.clears.append(now)
                    flushed = [item for item in self.buffer if isinstance(item, str)]
                    self.buffer.clear()
                    for name in flushed:
                        await self._echo(name, now, after_clear=True)
                else:
                    self.log.other.append(message)

    async def _echo(self, name: str, at: float, after_clear: bool) -> None:
        self.log.echoes.append(Echo(at, name, after_clear))
        await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def _echo_ready_marks(self, now: float) -> None:
        while self.buffer and isinstance(self.buffer[0], str):
            name = self.buffer.popleft()
            assert isinstance(name, str)
            await self._echo(name, now, after_clear=False)

    async def _play(self) -> None:
        """Every 20 ms (drift-free), 160 samples leave the buffer for the caller's ear."""
        tick = self.now()
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                tick += FRAME_S
                await asyncio.sleep(max(0.0, tick - self.now()))
                need, taken = FRAME, bytearray()
                while need and self.buffer and isinstance(self.buffer[0], bytes):
                    audio = self.buffer.popleft()
                    assert isinstance(audio, bytes)
                    taken += audio[:need]
                    if len(audio) > need:
                        self.buffer.appendleft(audio[need:])
                    need = FRAME - len(taken)
                    if need:
                        await self._echo_ready_marks(self.now())  # a mark between two short frames
                if taken:
                    if self.log.first_audio_at is None:
                        self.log.first_audio_at = tick
                    self.log.played.append(Played(tick, bytes(taken)))
                await self._echo_ready_marks(self.now())

    # -- inbound: the caller's microphone ----------------------------------------------------------
    async def _speak(self) -> None:
        tick, index = self.now(), 0
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                tick += FRAME_S
                await asyncio.sleep(max(0.0, tick - self.now()))
                index += 1
                audio = SILENCE if self.caller_dbfs is None else tone_frame(self.caller_dbfs, index)
                await self._send(
                    {
                        "event": "media",
                        "streamSid": self.stream_sid,
                        "media": {
                            "track": "inbound",
                            "chunk": str(index),
                            "timestamp": str(index * 20),
                            "payload": base64.b64encode(audio).decode("ascii"),
                        },
                    }
                )


def frame_level_dbfs(frame: bytes) -> float:
    pcm = mulaw_decode(np.frombuffer(frame, dtype=np.uint8)).astype(np.float64)
    rms = float(np.sqrt(np.mean(pcm**2))) if len(pcm) else 0.0
    return 20 * math.log10(rms / 32768.0) if rms > 0 else -math.inf
