"""An asyncio client for Cadence's `WS /v1/stream` (needs only `websockets` and the stdlib schema).

    async with connect("ws://127.0.0.1:8000/v1/stream", voice="default") as session:
        async for event in session.speak("Hello there."):
            if isinstance(event, Packet):
                play(event.payload)
            elif isinstance(event, Words):
                ...

Text may also be streamed: `session.append(uid, text)` ... `session.end(uid)` while iterating
`session.events(uid)`. Barge-in: `session.interrupt(uid, played_ms=...)`; the iteration ends with
an `Interrupted` event (the server's fence). A false interruption: `session.pause(uid,
played_ms=...)` fences the stream the same way but keeps the rest (a `Paused` event), and
`session.unpause(uid)` goes on from the first sample after the fence (`Unpaused`, then its
packets); a pause left longer than the session's `pause_timeout_ms` ends as `Interrupted`.
A server at capacity answers `Queued` (position and expected wait; the audio follows once admitted)
or an `Error` `overloaded` with `retry_after_ms`. `PlaybackClock` tracks what a listener has heard
(and can pause with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from gateway.messages import BYTES_PER_SAMPLE, MESSAGE_REFUSED_CODES, Word, unpack_packet

# -- events ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    utterance_id: str
    stream: int


@dataclass(frozen=True, slots=True)
class Queued:
    """The server is at capacity: the utterance waits for admission, its audio comes later."""

    utterance_id: str
    position: int  # 1: admitted next
    expected_wait_ms: int
    received_at: float  # time.perf_counter() on arrival


@dataclass(frozen=True, slots=True)
class Packet:
    utterance_id: str
    stream: int
    seq: int
    sample_offset: int  # first sample's index on the utterance timeline (output rate)
    last: bool
    payload: bytes
    samples: int  # samples in the payload
    received_at: float  # time.perf_counter() on arrival


@dataclass(frozen=True, slots=True)
class Words:
    utterance_id: str
    source: str
    words: tuple[Word, ...]
    received_at: float = field(default=0.0, compare=False)  # time.perf_counter() on arrival


@dataclass(frozen=True, slots=True)
class Done:
    utterance_id: str
    duration_ms: int
    packets: int
    queued_ms: int = 0  # how long it waited for admission in the server's queue


@dataclass(frozen=True, slots=True)
class Interrupted:
    utterance_id: str
    played_ms: int
    position_source: str
    last_word: Word | None
    partial_word: Word | None
    spoken_text: str
    unspoken_text: str


@dataclass(frozen=True, slots=True)
class Paused:
    """speak.pause answered: what was heard (as `Interrupted`); no packet follows until unpaused."""

    utterance_id: str
    played_ms: int
    position_source: str
    last_word: Word | None
    partial_word: Word | None
    spoken_text: str
    unspoken_text: str


@dataclass(frozen=True, slots=True)
class Unpaused:
    utterance_id: str


@dataclass(frozen=True, slots=True)
class Error:
    code: str
    message: str
    utterance_id: str | None = None
    # overloaded, rate_limited: when a retry may be admitted; quota_exceeded: a hint; None: the
    # server knows no time (text_too_long is never admitted as it is)
    retry_after_ms: int | None = None
    # False: it refused one message about an utterance under way (an append past the limit, an
    # unpause of one not paused), and that utterance goes on to its Done
    ends_utterance: bool = True


Event = Started | Queued | Packet | Words | Done | Interrupted | Paused | Unpaused | Error
_TERMINAL = (Done, Interrupted, Error)


class ClientError(Exception):
    """The server refused the session (an `error` before `session.started`, or a closed socket)."""


def _word(raw: Mapping[str, Any] | None) -> Word | None:
    if not raw:
        return None
    return Word(
        int(raw["index"]),
        str(raw["text"]),
        int(raw["start_ms"]),
        int(raw["end_ms"]),
        int(raw["char_start"]),
        int(raw["char_end"]),
    )


def decode_event(raw: Mapping[str, Any]) -> Event | None:
    """A server JSON message as a typed event (None for session-level messages)."""
    kind = raw.get("type")
    uid = str(raw.get("utterance_id", ""))
    if kind == "utterance.started":
        return Started(uid, int(raw["stream"]))
    if kind == "utterance.queued":
        return Queued(uid, int(raw["position"]), int(raw["expected_wait_ms"]), time.perf_counter())
    if kind == "words":
        words = tuple(w for w in (_word(item) for item in raw.get("words", ())) if w is not None)
        return Words(uid, str(raw.get("source", "")), words, time.perf_counter())
    if kind == "utterance.done":
        return Done(uid, int(raw["duration_ms"]), int(raw["packets"]), int(raw.get("queued_ms", 0)))
    if kind in ("utterance.interrupted", "utterance.paused"):
        report = Interrupted if kind == "utterance.interrupted" else Paused
        return report(
            uid,
            int(raw["played_ms"]),
            str(raw.get("position_source", "")),
            _word(raw.get("last_word")),
            _word(raw.get("partial_word")),
            str(raw.get("spoken_text", "")),
            str(raw.get("unspoken_text", "")),
        )
    if kind == "utterance.unpaused":
        return Unpaused(uid)
    if kind == "error":
        retry = raw.get("retry_after_ms")
        return Error(
            str(raw.get("code", "")),
            str(raw.get("message", "")),
            raw.get("utterance_id"),
            int(retry) if isinstance(retry, int | float) and not isinstance(retry, bool) else None,
        )
    return None


def decode_packet(frame: bytes, utterance_id: str, bytes_per_sample: int, at: float) -> Packet:
    header, payload = unpack_packet(frame)
    return Packet(
        utterance_id,
        header.stream,
        header.seq,
        header.sample_offset,
        header.last,
        payload,
        len(payload) // bytes_per_sample,
        at,
    )


# -- playback -------------------------------------------------------------------------------------


class PlaybackClock:
    """What a real player would have played: it starts `buffer_ms` after the first packet, runs at
    real time, never past what was received, stalls when it runs dry and resumes when audio
    comes. A packet that arrives after the player ran dry is an underrun: `first_underrun_s` is the
    audio position of the first one, `stall_s` the total time the player sat dry."""

    def __init__(
        self, sample_rate: int, buffer_ms: float = 150.0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.sample_rate = sample_rate
        self.buffer_s = buffer_ms / 1000.0
        self._clock = clock
        self.received = 0  # samples
        self.underruns = 0
        self.first_underrun_s: float | None = None  # audio position (s) when it first ran dry
        self.stall_s = 0.0
        self.first_packet_at: float | None = None
        self._anchor_at = 0.0  # playing from `_anchor_pos` at time `_anchor_at`
        self._anchor_pos = 0
        self._paused_at: float | None = None

    def on_packet(self, samples: int, at: float | None = None) -> None:
        at = self._clock() if at is None else at
        if self.first_packet_at is None:
            self.first_packet_at = at
            self._anchor_at = at + self.buffer_s
        # an empty packet (the header-only last one) brings no audio: its coming late is no underrun
        elif (
            samples
            and self._paused_at is None
            and at > self._anchor_at
            and self._position(at) >= self.received
        ):
            self.underruns += 1  # the player ran dry before this packet came: resume from now
            dry_at = self._anchor_at + (self.received - self._anchor_pos) / self.sample_rate
            self.stall_s += max(0.0, at - dry_at)
            if self.first_underrun_s is None:
                self.first_underrun_s = self.received / self.sample_rate
            self._anchor_at, self._anchor_pos = at, self.received
        self.received += samples

    def pause(self, at: float | None = None) -> None:
        """The player stops (a pause): the position holds until `resume`."""
        at = self._clock() if at is None else at
        if self._paused_at is None:
            self._anchor_pos, self._anchor_at = self.played_samples(at), max(at, self._anchor_at)
            self._paused_at = at

    def resume(self, at: float | None = None) -> None:
        """The player goes on from where it paused."""
        at = self._clock() if at is None else at
        if self._paused_at is not None:
            self._paused_at = None
            self._anchor_at = max(at, self._anchor_at)

    def _position(self, at: float) -> int:
        if self._paused_at is not None or at <= self._anchor_at:
            return self._anchor_pos
        return self._anchor_pos + int((at - self._anchor_at) * self.sample_rate)

    def played_samples(self, at: float | None = None) -> int:
        if self.first_packet_at is None:
            return 0
        at = self._clock() if at is None else at
        return min(self._position(at), self.received)

    def played_ms(self, at: float | None = None) -> int:
        return self.played_samples(at) * 1000 // self.sample_rate


# -- the session ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Utterance:
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    stream: int | None = None
    finished: bool = False


class Session:
    """One open `/v1/stream` session; use `connect()`."""

    def __init__(
        self, socket: ClientConnection, on_interrupt: Callable[[Interrupted], object] | None = None
    ) -> None:
        self._socket = socket
        self._on_interrupt = on_interrupt
        self._utterances: dict[str, _Utterance] = {}
        self._streams: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()
        self.session_id = ""
        self.output: dict[str, Any] = {}
        self.engine: dict[str, Any] = {}
        self.sample_rate = 24_000
        self.bytes_per_sample = 2
        self.errors: list[Error] = []  # errors not tied to an utterance
        self.stray_packets = 0  # packets of streams not (or no longer) announced

    @property
    def closed(self) -> bool:
        """The session has ended (session.ended came, or the connection is gone)."""
        return self._ended.is_set()

    async def _start(self, options: Mapping[str, Any]) -> None:
        await self._send({"type": "session.start", **options})
        while True:
            raw = json.loads(await self._socket.recv())
            if raw.get("type") == "session.started":
                break
            if raw.get("type") == "error":
                raise ClientError(f"{raw.get('code')}: {raw.get('message')}")
        self.session_id = str(raw.get("session_id", ""))
        self.output = dict(raw.get("output", {}))
        self.engine = dict(raw.get("engine", {}))
        self.sample_rate = int(self.output.get("sample_rate", 24_000))
        self.bytes_per_sample = BYTES_PER_SAMPLE.get(self.output.get("encoding", "pcm_s16le"), 2)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    # -- sending -------------------------------------------------------------------------------------
    async def _send(self, message: Mapping[str, Any]) -> None:
        await self._socket.send(json.dumps(message, ensure_ascii=False, separators=(",", ":")))

    def new_utterance_id(self) -> str:
        return f"u{next(self._ids)}"

    def _utterance(self, utterance_id: str) -> _Utterance:
        if utterance_id not in self._utterances:
            self._utterances[utterance_id] = _Utterance()
        return self._utterances[utterance_id]

    async def append(self, utterance_id: str, text: str, flush: bool = False, **extra: Any) -> None:
        """Send text for an utterance (opens it on first use). `extra` fields go into the message."""
        self._utterance(utterance_id)
        message: dict[str, Any] = {"type": "speak.append", "utterance_id": utterance_id, "text": text}
        if flush:
            message["flush"] = True
        await self._send({**message, **extra})

    async def flush(self, utterance_id: str) -> None:
        await self._send({"type": "speak.flush", "utterance_id": utterance_id})

    async def end(self, utterance_id: str) -> None:
        await self._send({"type": "speak.end", "utterance_id": utterance_id})

    async def interrupt(self, utterance_id: str | None = None, played_ms: int | None = None) -> None:
        """Barge-in (speak.cancel); the utterance's events end with `Interrupted`."""
        message: dict[str, Any] = {"type": "speak.cancel"}
        if utterance_id is not None:
            message["utterance_id"] = utterance_id
        if played_ms is not None:
            message["played_ms"] = int(played_ms)
        await self._send(message)

    async def pause(self, utterance_id: str | None = None, played_ms: int | None = None) -> None:
        """speak.pause (a possible false interruption): the utterance's events go on with `Paused`,
        and nothing of it comes until `unpause` (or, after the pause timeout, `Interrupted`)."""
        message: dict[str, Any] = {"type": "speak.pause"}
        if utterance_id is not None:
            message["utterance_id"] = utterance_id
        if played_ms is not None:
            message["played_ms"] = int(played_ms)
        await self._send(message)

    async def unpause(self, utterance_id: str | None = None) -> None:
        """speak.unpause: `Unpaused`, then the audio from the first sample after the fence."""
        message: dict[str, Any] = {"type": "speak.unpause"}
        if utterance_id is not None:
            message["utterance_id"] = utterance_id
        await self._send(message)

    async def report(self, utterance_id: str, played_ms: int) -> None:
        await self._send(
            {"type": "playback.report", "utterance_id": utterance_id, "played_ms": int(played_ms)}
        )

    async def resume(self, utterance_id: str, from_utterance: str) -> None:
        """Speak what the listener did not hear of an interrupted utterance, as a new one."""
        self._utterance(utterance_id)
        await self._send(
            {"type": "speak.resume", "utterance_id": utterance_id, "from_utterance": from_utterance}
        )

    # -- receiving -----------------------------------------------------------------------------------
    async def events(self, utterance_id: str) -> AsyncIterator[Event]:
        """Events of one utterance until its Done, Interrupted or an Error that ends it."""
        utterance = self._utterance(utterance_id)
        try:
            while True:
                event = await utterance.queue.get()
                yield event
                if isinstance(event, _TERMINAL) and getattr(event, "ends_utterance", True):
                    return
        finally:
            utterance.finished = True
            self._forget(utterance_id)

    async def speak(self, text: str, utterance_id: str | None = None, **extra: Any) -> AsyncIterator[Event]:
        """Send a whole text (append + end) and yield its events."""
        uid = utterance_id or self.new_utterance_id()
        await self.append(uid, text, **extra)
        await self.end(uid)
        async for event in self.events(uid):
            yield event

    def _forget(self, utterance_id: str) -> None:
        utterance = self._utterances.pop(utterance_id, None)
        if utterance is not None and utterance.stream is not None:
            self._streams.pop(utterance.stream, None)

    async def _read(self) -> None:
        try:
            async for frame in self._socket:
                if isinstance(frame, bytes):
                    self._on_packet(frame)
                else:
                    self._on_message(json.loads(frame))
        except websockets.ConnectionClosed:
            pass
        finally:
            self._ended.set()
            closed = Error("connection_closed", "the server closed the connection")
            for utterance in list(self._utterances.values()):
                utterance.queue.put_nowait(closed)

    def _on_packet(self, frame: bytes) -> None:
        at = time.perf_counter()
        stream = int.from_bytes(frame[2:4], "little")
        uid = self._streams.get(stream)
        utterance = None if uid is None else self._utterances.get(uid)
        if uid is None or utterance is None:
            # of an utterance nobody listens to (never after a fence), or whose listener has gone
            self.stray_packets += 1
            return
        utterance.queue.put_nowait(decode_packet(frame, uid, self.bytes_per_sample, at))

    def _on_message(self, raw: dict[str, Any]) -> None:
        kind = raw.get("type")
        if kind == "session.ended":
            self._ended.set()
            return
        event = decode_event(raw)
        if event is None:
            return
        if isinstance(event, Started):
            self._streams[event.stream] = event.utterance_id
        if isinstance(event, Interrupted) and self._on_interrupt is not None:
            self._on_interrupt(event)
        uid = getattr(event, "utterance_id", None)
        if uid and uid in self._utterances:
            utterance = self._utterances[uid]
            if isinstance(event, Started):
                utterance.stream = event.stream
            elif (
                isinstance(event, Error)
                and utterance.stream is not None
                and event.code in MESSAGE_REFUSED_CODES
            ):
                event = dataclasses.replace(event, ends_utterance=False)
            utterance.queue.put_nowait(event)
        elif isinstance(event, Error):
            self.errors.append(event)
            if not uid:  # a session-level error: every open utterance learns of it
                for utterance in self._utterances.values():
                    utterance.queue.put_nowait(event)

    async def close(self, timeout_s: float = 2.0) -> None:
        """session.end, wait (bounded) for session.ended, close the socket."""
        with contextlib.suppress(websockets.ConnectionClosed):
            await self._send({"type": "session.end"})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ended.wait(), timeout_s)
        await self._socket.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


@contextlib.asynccontextmanager
async def connect(
    url: str,
    *,
    voice: str | None = None,
    language: str | None = None,
    instructions: str | None = None,
    encoding: str | None = None,
    sample_rate: int | None = None,
    packet_ms: int | None = None,
    timestamps: str = "word",
    pacing: str = "asap",
    pause_timeout_ms: int | None = None,
    token: str | None = None,
    on_interrupt: Callable[[Interrupted], object] | None = None,
    open_timeout: float = 10.0,
    **extra: Any,
) -> AsyncIterator[Session]:
    """Open a session (session.start with these options; `extra` fields are passed through)."""
    options: dict[str, Any] = {"timestamps": timestamps, "pacing": pacing, **extra}
    if pause_timeout_ms is not None:
        options["pause_timeout_ms"] = pause_timeout_ms
    for name, value in (("voice", voice), ("language", language), ("instructions", instructions)):
        if value is not None:
            options[name] = value
    output = {
        k: v for k, v in (("encoding", encoding), ("sample_rate", sample_rate), ("packet_ms", packet_ms)) if v
    }
    if output:
        options["output"] = output
    headers = {"Authorization": f"Bearer {token}"} if token else None
    socket = await websockets.connect(
        url, additional_headers=headers, open_timeout=open_timeout, max_size=None, compression=None
    )
    session = Session(socket, on_interrupt)
    try:
        await session._start(options)
        yield session
    finally:
        await session.close()
