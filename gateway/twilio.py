"""`WS /v1/twilio`: a target for Twilio `<Connect><Stream>` bidirectional Media Streams, and the
agent's control channel `WS /v1/twilio/control/{callSid}` (docs/twilio.md).

Twilio sends connected / start / media (inbound μ-law 8 kHz) / mark / dtmf / stop; we send μ-law
8 kHz `media` in 20 ms frames, a `mark` after the frame in which each word ends (and one at the end
of each utterance), and `clear` on barge-in. Twilio echoes a mark when the audio before it has
played, and on `clear` it echoes every mark still buffered: so the last word heard is the last
word whose mark came back *before* we decided to clear; marks arriving after that prove nothing
and are ignored.

Barge-in comes from the caller (an energy VAD on the inbound audio, with a threshold, an attack
and a hang time) or from the agent (`speak.cancel`). The agent speaks with the `/v1/stream`
vocabulary (session.start, speak.append / flush / end / cancel / pause / unpause) and hears back
the call's events.

The call's utterances live in the same sans-I/O `SessionProtocol` as a `/v1/stream` session: the
marks that come back are its playback reports, `clear` is its fence, and after a pause that
cleared Twilio's buffer the audio from the fence on is handed back to it, to be sent again at the
unpause.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol

import numpy as np
import numpy.typing as npt
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.api import Engine, EngineError, SynthesisStream
from gateway.config import GatewayConfig
from gateway.messages import (
    PacketHeader,
    PlaybackReport,
    ProtocolError,
    SessionEnd,
    SessionStart,
    SpeakAppend,
    SpeakCancel,
    SpeakEnd,
    SpeakFlush,
    SpeakPause,
    SpeakUnpause,
    decode,
    encode,
)
from gateway.packets import Packet, mulaw_decode
from gateway.protocol import (
    Action,
    CancelStream,
    CloseText,
    Hold,
    OpenStream,
    Purge,
    PushText,
    SendAudio,
    SendControl,
    SendTrailer,
    SessionProtocol,
    Throttle,
    WakeAt,
)
from gateway.webhooks import WebhookSender, interruption_payload

log = logging.getLogger("cadence.twilio")

RATE: Final = 8000
FRAME_MS: Final = 20
FRAME_SAMPLES: Final = RATE * FRAME_MS // 1000
CLOSE_POLICY: Final = 1008
BargeInBy = Literal["caller", "agent"]


class AgentSink(Protocol):
    """Where a call's events for its agent go: the agent's WebSocket, or a link to the replica
    that holds it (gateway.cluster.calls)."""

    async def send_text(self, data: str) -> None: ...


AgentFrame = str | bytes | None  # a text or binary frame from the agent; None: it has gone


class CallRouter(Protocol):
    """With several replicas: the call directory and the relay of a control channel that lands on
    a replica other than the one holding the call's media stream (gateway.cluster.calls)."""

    def call_started(self, call_sid: str) -> None: ...

    def call_ended(self, call_sid: str, reason: str) -> None: ...

    async def serve_agent(self, websocket: WebSocket, call_sid: str) -> None: ...


# -- options and the inbound VAD --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TwilioOptions:
    vad_threshold_dbfs: float = -35.0  # an inbound frame louder than this counts as speech
    vad_attack_ms: int = 60  # speech this long starts a turn (and a barge-in)
    vad_hang_ms: int = 400  # quiet this long ends it
    barge_in_on_speech: bool = True

    def with_parameters(self, params: Mapping[str, Any]) -> TwilioOptions:
        """Per-call overrides from the `<Stream>`'s `<Parameter>`s (names as the fields)."""
        changes: dict[str, Any] = {}
        for name, kind in (("vad_threshold_dbfs", float), ("vad_attack_ms", int), ("vad_hang_ms", int)):
            if name in params:
                with contextlib.suppress(TypeError, ValueError):
                    changes[name] = kind(params[name])
        if "barge_in_on_speech" in params:
            changes["barge_in_on_speech"] = str(params["barge_in_on_speech"]).lower() not in (
                "0",
                "false",
                "no",
            )
        return replace(self, **changes)


def frame_dbfs(pcm: npt.NDArray[np.int16]) -> float:
    """RMS level of 16-bit samples in dB relative to full scale (-inf for digital silence)."""
    if len(pcm) == 0:
        return -math.inf
    rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float64)))))
    return 20.0 * math.log10(rms / 32768.0) if rms > 0 else -math.inf


class EnergyVad:
    """Speech starts after `attack_ms` of frames above the threshold, ends after `hang_ms` below."""

    def __init__(self, threshold_dbfs: float, attack_ms: int, hang_ms: int) -> None:
        self.threshold_dbfs = threshold_dbfs
        self.attack_ms = attack_ms
        self.hang_ms = hang_ms
        self.speaking = False
        self._loud_ms = 0.0
        self._quiet_ms = 0.0

    def feed(self, pcm: npt.NDArray[np.int16]) -> Literal["start", "stop"] | None:
        ms = len(pcm) * 1000 / RATE
        loud = frame_dbfs(pcm) > self.threshold_dbfs
        if not self.speaking:
            self._loud_ms = self._loud_ms + ms if loud else 0.0
            if self._loud_ms >= self.attack_ms:
                self.speaking, self._quiet_ms = True, 0.0
                return "start"
            return None
        self._quiet_ms = 0.0 if loud else self._quiet_ms + ms
        if self._quiet_ms >= self.hang_ms:
            self.speaking, self._loud_ms = False, 0.0
            return "stop"
        return None


# -- one utterance on the phone line ----------------------------------------------------------


class _Done:
    """utterance.done in a line's queue, behind its last frame."""

    __slots__ = ("message",)

    def __init__(self, message: Mapping[str, Any]) -> None:
        self.message = message


@dataclass(eq=False, slots=True)
class PhoneUtterance:
    """What the line knows of one utterance; its life (text, words, pause, barge-in) is the
    session protocol's."""

    utterance_id: str
    stream: int
    engine_stream: SynthesisStream
    pull: asyncio.Task[None] | None = None
    gate: asyncio.Event | None = None  # while throttled: the engine's chunks wait for it
    queue: deque[Packet | _Done] = field(default_factory=deque)  # for Twilio, in order
    sent: deque[Packet] = field(default_factory=deque)  # sent, not yet known to be heard
    word_ends: list[int] = field(default_factory=list)  # each word's end, in 8 kHz samples
    next_mark: int = 0  # the next word to mark
    on_line: bool = False  # audio of it is in Twilio's buffer (sent since the last clear)
    all_sent: bool = False  # the last frame and the end mark are sent
    state: Literal["active", "played", "interrupted", "failed"] = "active"
    paused: bool = False
    fence: int | None = None  # a pause that cleared Twilio's buffer: audio from here is sent again
    by: BargeInBy = "agent"  # who stopped it last
    heard_index: int = -1  # the last word whose mark came back before any clear
    anchor: tuple[int, float] | None = None  # the caller was at this 8 kHz sample then, and plays on
    resume_from: int = 0  # where playing starts (again, after a pause)
    sent_samples: int = 0  # the end of the last frame sent
    report: dict[str, Any] | None = None  # its utterance.interrupted, as the agent got it

    @property
    def live(self) -> bool:
        return self.state == "active"


def mark_name(utterance_id: str, index: int | None) -> str:
    return f"{utterance_id}/end" if index is None else f"{utterance_id}/w{index}"


@dataclass(frozen=True, slots=True)
class _Mark:
    utterance: PhoneUtterance
    index: int | None  # the word, or None: the utterance's end
    position: int  # 8 kHz samples of the utterance played when it comes back


def _from(packet: Packet, sample: int) -> Packet:
    """`packet` from `sample` of the utterance's timeline on (8 kHz μ-law: a byte a sample)."""
    cut = sample - packet.sample_offset
    if cut <= 0:
        return packet
    header = PacketHeader(packet.stream, packet.seq, sample, packet.flags)
    frame = header.pack() + packet.payload[cut:]
    return Packet(packet.stream, packet.seq, sample, packet.flags, packet.samples - cut, frame)


# -- the call ---------------------------------------------------------------------------------


class Call:
    """One phone call: the Twilio socket, the agent's socket (either may come first) and the
    utterances being spoken on the line, in order. The agent's messages, the engine's audio and
    the echoed marks go through a `SessionProtocol` (the one of `/v1/stream`); this class is its
    I/O: it plays one utterance after the other, sends marks and `clear`, and maps the
    protocol's answers onto the control channel's messages."""

    def __init__(
        self,
        call_sid: str,
        engine: Engine,
        config: GatewayConfig,
        options: TwilioOptions,
        webhooks: WebhookSender,
    ) -> None:
        self.call_sid = call_sid
        self.engine = engine
        self.config = config
        self.options = options
        self.webhooks = webhooks
        self.loop = asyncio.get_running_loop()
        line_config = replace(
            config,
            default_encoding="mulaw",
            default_sample_rate=RATE,
            default_packet_ms=FRAME_MS,
            idle_timeout_s=math.inf,  # the call lasts as long as Twilio's stream
            history_size=max(config.history_size, 64),  # a line plays long after the audio is made
        )
        self.protocol = SessionProtocol(f"twilio/{call_sid}", engine.info, line_config, now=self.loop.time())
        self.protocol.started = True  # the control channel has no session.started
        self.stream_sid: str | None = None
        self.start_info: dict[str, Any] = {}
        self.twilio: WebSocket | None = None
        self.agent: AgentSink | None = None
        self.ended = False
        self.end_reason: str | None = None
        self.webhook_url: str | None = None
        self.utterances: dict[str, PhoneUtterance] = {}  # in the order they were opened
        self._streams: dict[int, PhoneUtterance] = {}
        self.vad = EnergyVad(options.vad_threshold_dbfs, options.vad_attack_ms, options.vad_hang_ms)
        self._marks: dict[str, _Mark] = {}  # sent, not yet back, not voided by a clear
        self._to_twilio: deque[dict[str, Any]] = deque()  # control (clear), ahead of media
        self._to_agent: asyncio.Queue[str | None] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._done = asyncio.Event()

    # -- the Twilio side ----------------------------------------------------------------------
    def on_start(self, message: Mapping[str, Any]) -> None:
        start = message.get("start") or {}
        self.stream_sid = str(message.get("streamSid") or start.get("streamSid") or "")
        self.start_info = dict(start)
        params = start.get("customParameters") or {}
        self.options = self.options.with_parameters(params)
        self.vad = EnergyVad(
            self.options.vad_threshold_dbfs, self.options.vad_attack_ms, self.options.vad_hang_ms
        )
        self.protocol.voice = params.get("voice") or self.protocol.voice
        self.protocol.language = params.get("language") or self.protocol.language
        url = params.get("webhook_url")
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            self.webhook_url = url
        self.to_agent(self._call_started())
        self._wake.set()

    def _call_started(self) -> dict[str, Any]:
        return {
            "type": "call.started",
            "call_sid": self.call_sid,
            "stream_sid": self.stream_sid,
            "custom_parameters": dict(self.start_info.get("customParameters") or {}),
            "media_format": self.start_info.get("mediaFormat"),
        }

    def on_twilio(self, message: Mapping[str, Any], now: float) -> None:
        event = message.get("event")
        if event == "media":
            self._on_media(message.get("media") or {}, now)
        elif event == "mark":
            self._on_mark(str((message.get("mark") or {}).get("name", "")), now)
        elif event == "dtmf":
            self.to_agent({"type": "dtmf", "digit": str((message.get("dtmf") or {}).get("digit", ""))})
        elif event == "stop":
            self.end("stop")

    def _on_media(self, media: Mapping[str, Any], now: float) -> None:
        if media.get("track", "inbound") not in ("inbound", "inbound_track"):
            return
        try:
            codes = np.frombuffer(
                base64.b64decode(str(media.get("payload", "")), validate=True), dtype=np.uint8
            )
        except (binascii.Error, ValueError):
            return
        change = self.vad.feed(mulaw_decode(codes))
        if change == "start":
            self.to_agent({"type": "speech.started"})
            if self.options.barge_in_on_speech and any(u.live for u in self.utterances.values()):
                self.interrupt(None, "caller", now)
        elif change == "stop":
            self.to_agent({"type": "speech.stopped"})

    def _on_mark(self, name: str, now: float) -> None:
        """A mark came back: a playback report (the audio before it has been heard)."""
        mark = self._marks.pop(name, None)
        if mark is None:
            return  # voided by a clear, or not ours
        line = mark.utterance
        line.anchor = (mark.position, now)
        while line.sent and line.sent[0].end_sample < mark.position - FRAME_SAMPLES:
            line.sent.popleft()  # heard: never sent again (a frame kept for a fence just before)
        if mark.index is not None:
            line.heard_index = max(line.heard_index, mark.index)
        elif line.live:
            line.state, line.on_line = "played", False
            self.to_agent({"type": "utterance.played", "utterance_id": line.utterance_id})
        if self.protocol.utterance(line.utterance_id) is not None:
            report = PlaybackReport(line.utterance_id, mark.position * 1000 // RATE)
            self._run(self.protocol.receive_message(report, now))

    async def write_twilio(self, websocket: WebSocket) -> None:
        """The one writer of the Twilio socket: clears first, then the utterances' media in order."""
        while not self.ended:
            if self.stream_sid is None:
                await self._sleep()
                continue
            if self._to_twilio:
                await websocket.send_text(encode(self._to_twilio.popleft()))
                continue
            line = self._playing()
            if line is None or not line.queue:
                await self._sleep()
                continue
            item = line.queue.popleft()
            if isinstance(item, _Done):
                done = {k: item.message[k] for k in ("type", "utterance_id", "duration_ms")}
                self.to_agent(done)
                self._run(self.protocol.trailer_sent(line.stream))
                continue
            line.sent.append(item)  # before the send: a pause meanwhile sends it again
            line.on_line = True
            await websocket.send_text(encode(self._twilio_message("media", payload=item.payload)))
            now = self.loop.time()
            self._run(self.protocol.packet_sent(line.stream, item, now))
            if line.live and not line.paused and not self._to_twilio:
                for message in self._after_packet(line, item, now):
                    await websocket.send_text(encode(message))

    async def _sleep(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _playing(self) -> PhoneUtterance | None:
        """The utterance whose audio goes on the line now: the first live one not fully sent (none
        while that one is paused: the others wait behind it)."""
        for line in self.utterances.values():
            if line.live and (not line.all_sent or line.queue):  # (its utterance.done may wait)
                return None if line.paused else line
        return None

    def _twilio_message(
        self, event: str, payload: bytes | None = None, name: str | None = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"event": event, "streamSid": self.stream_sid}
        if payload is not None:
            message["media"] = {"payload": base64.b64encode(payload).decode("ascii")}
        if name is not None:
            message["mark"] = {"name": name}
        return message

    def _after_packet(self, line: PhoneUtterance, packet: Packet, now: float) -> list[dict[str, Any]]:
        """Bookkeeping after a media frame went out; the marks that follow it."""
        if line.anchor is None:
            line.anchor = (line.resume_from, now)
        line.sent_samples = packet.end_sample
        out = []
        while line.next_mark < len(line.word_ends) and (
            packet.last or line.word_ends[line.next_mark] <= packet.end_sample
        ):
            out.append(self._mark(line, line.next_mark, packet.end_sample))
            line.next_mark += 1
        if packet.last:
            out.append(self._mark(line, None, packet.end_sample))
            line.all_sent = True
        return out

    def _mark(self, line: PhoneUtterance, index: int | None, position: int) -> dict[str, Any]:
        name = mark_name(line.utterance_id, index)
        self._marks[name] = _Mark(line, index, position)
        return self._twilio_message("mark", name=name)

    # -- barge-in and pause ---------------------------------------------------------------------
    def interrupt(self, utterance_id: str | None, by: BargeInBy, now: float) -> None:
        """Stop `utterance_id` (None: every live one); clear Twilio's buffer when it holds audio
        of it (which stops every utterance with audio there) and report what was heard."""
        live = [u for u in self.utterances.values() if u.live]
        if utterance_id is None:
            targets = live
        else:
            target = self._line(utterance_id)
            if not target.live:
                if target.report is not None:
                    self.to_agent(target.report)  # the same report again (and no second webhook)
                return
            targets = [target]
        for line, (played_ms, heard) in self._stop_listening(targets, live, now):
            line.by = by
            self._stop_one(self.protocol.cancel, line, now, played_ms, heard)
        self._wake.set()

    def pause(self, utterance_id: str | None, by: BargeInBy, now: float) -> None:
        """Pause `utterance_id` (None: every live one); as `interrupt`, a `clear` pauses every
        utterance with audio in Twilio's buffer. What the caller did not hear is sent again at the
        unpause."""
        live = [u for u in self.utterances.values() if u.live]
        if utterance_id is None:
            targets = [u for u in live if not u.paused]
        else:
            target = self._line(utterance_id)
            if not target.live:
                raise ProtocolError("utterance_closed", f"utterance {utterance_id!r} has ended", utterance_id)
            if target.paused:
                self._run(self.protocol.pause(utterance_id, now))  # the same answer again
                return
            targets = [target]
        for line, (played_ms, heard) in self._stop_listening(targets, live, now):
            line.by = by
            self._stop_one(self.protocol.pause, line, now, played_ms, heard)
        self._wake.set()

    def _stop_one(
        self,
        stop: Callable[..., list[Action]],
        line: PhoneUtterance,
        now: float,
        played_ms: int | None,
        heard: int | None,
    ) -> None:
        """One utterance's part of a barge-in or pause (`protocol.cancel` / `protocol.pause`): a
        refusal (an utterance the protocol no longer knows) goes to the agent, the others go on."""
        try:
            actions = stop(line.utterance_id, now, played_ms=played_ms, heard_index=heard, source="marks")
        except ProtocolError as exc:
            self._error(exc.code, exc.message, exc.utterance_id)
            return
        self._run(actions)

    def _line(self, utterance_id: str) -> PhoneUtterance:
        line = self.utterances.get(utterance_id)
        if line is None:
            raise ProtocolError("unknown_utterance", f"no utterance {utterance_id!r}", utterance_id)
        return line

    def _stop_listening(
        self, targets: list[PhoneUtterance], live: list[PhoneUtterance], now: float
    ) -> list[tuple[PhoneUtterance, tuple[int | None, int | None]]]:
        """Where the caller is in each target, from the marks back before the `clear` that this
        sends when a target has audio in Twilio's buffer (the other utterances there join the
        targets: clear empties the whole buffer). A paused one's position is the protocol's."""
        clear = any(u.on_line for u in targets)
        if clear:
            targets = list(dict.fromkeys(targets + [u for u in live if u.on_line]))
        positions: list[tuple[int | None, int | None]] = []
        for line in targets:
            if line.paused:
                positions.append((None, None))
                continue
            played_ms = self._played_samples(line, now) * 1000 // RATE
            positions.append((played_ms, line.heard_index))
            line.fence = played_ms * RATE // 1000 if line.on_line else None
        if clear:
            self._to_twilio.append(self._twilio_message("clear"))
            cleared = {u for u in targets if u.on_line}
            self._marks = {k: m for k, m in self._marks.items() if m.utterance not in cleared}
            for line in cleared:
                line.on_line = False
        return list(zip(targets, positions, strict=True))

    def _played_samples(self, line: PhoneUtterance, now: float) -> int:
        """Between the last mark back and the next one out: extrapolated at real time from the
        last mark's return (or from the first frame sent), capped at the next mark's place."""
        if line.anchor is None:
            return line.resume_from
        base, since = line.anchor
        cap = min([m.position for m in self._marks.values() if m.utterance is line] + [line.sent_samples])
        estimate = base + int(max(0.0, now - since) * RATE)
        return max(base, min(estimate, cap))

    def _stop(self, line: PhoneUtterance, state: Literal["interrupted", "failed"]) -> None:
        line.state = state
        line.queue.clear()
        line.sent.clear()
        line.on_line = False
        self._marks = {k: m for k, m in self._marks.items() if m.utterance is not line}
        self._end_engine(line)

    def _end_engine(self, line: PhoneUtterance) -> None:
        with contextlib.suppress(Exception):
            line.engine_stream.cancel()
        if line.gate is not None:
            line.gate.set()
        if line.pull is not None and line.pull is not asyncio.current_task():
            line.pull.cancel()

    # -- the agent side -----------------------------------------------------------------------
    def to_agent(self, message: Mapping[str, Any]) -> None:
        if self.agent is not None:
            self._to_agent.put_nowait(encode(message))

    def attach_agent(self, sink: AgentSink) -> None:
        self.agent = sink
        self._to_agent = asyncio.Queue()
        if self.stream_sid is not None:
            self.to_agent(self._call_started())

    def detach_agent(self) -> None:
        self.agent = None
        self._to_agent.put_nowait(None)

    async def write_agent(self, sink: AgentSink) -> None:
        queue = self._to_agent
        while True:
            item = await queue.get()
            if item is None:
                return
            await sink.send_text(item)

    def on_agent(self, frame: str) -> None:
        try:
            message = decode(frame)
            now = self.loop.time()
            if isinstance(message, SessionStart):
                self.protocol.voice = message.voice or self.protocol.voice
                self.protocol.language = message.language or self.protocol.language
                self.protocol.instructions = message.instructions or self.protocol.instructions
                self.webhook_url = message.webhook_url or self.webhook_url
                if message.pause_timeout_ms is not None:
                    self.protocol.pause_timeout_ms = message.pause_timeout_ms
            elif isinstance(message, SpeakAppend | SpeakFlush | SpeakEnd | SpeakUnpause):
                self._run(self.protocol.receive_message(message, now))
            elif isinstance(message, SpeakCancel):
                self.interrupt(message.utterance_id, "agent", now)
            elif isinstance(message, SpeakPause):
                self.pause(message.utterance_id, "agent", now)
            elif isinstance(message, SessionEnd):
                self.detach_agent()
            else:
                raise ProtocolError(
                    "unknown_type", f"{message.type} is not offered on the Twilio control channel"
                )
        except ProtocolError as exc:
            self._error(exc.code, exc.message, exc.utterance_id)

    def _error(self, code: str, message: str, utterance_id: str | None = None) -> None:
        error: dict[str, Any] = {"type": "error", "code": code, "message": message}
        if utterance_id is not None:
            error["utterance_id"] = utterance_id
        self.to_agent(error)

    # -- the protocol's actions -----------------------------------------------------------------
    def _run(self, actions: list[Action]) -> None:
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if isinstance(action, SendAudio):
                line = self._streams.get(action.stream)
                if line is not None and line.live:
                    line.queue.extend(action.packets)
                    self._wake.set()
            elif isinstance(action, SendControl):
                self._to_agent_from_protocol(action.message)
            elif isinstance(action, SendTrailer):
                line = self._streams.get(action.stream)
                if line is not None and line.live:
                    line.queue.append(_Done(action.message))
                    self._wake.set()
            elif isinstance(action, Purge):
                line = self._streams.get(action.stream)
                if line is not None:
                    line.queue.clear()
            elif isinstance(action, OpenStream):
                pending.extendleft(reversed(self._open(action)))
            elif isinstance(action, PushText):
                pending.extendleft(reversed(self._push(action)))
            elif isinstance(action, CloseText):
                line = self.utterances.get(action.utterance_id)
                if line is not None:
                    with contextlib.suppress(Exception):
                        line.engine_stream.close_text()
            elif isinstance(action, CancelStream):
                line = self.utterances.get(action.utterance_id)
                if line is not None:
                    self._end_engine(line)
            elif isinstance(action, Hold):
                pending.extendleft(reversed(self._hold(action)))
            elif isinstance(action, Throttle):
                self._throttle(action)
            elif isinstance(action, WakeAt):
                self.loop.call_at(action.at, self._tick)
            # Unhold: the line is not paced; Close: the call lasts as long as Twilio's stream

    def _to_agent_from_protocol(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        line = self.utterances.get(str(message.get("utterance_id", "")))
        if kind == "utterance.started":
            self.to_agent({"type": kind, "utterance_id": message["utterance_id"]})
        elif kind == "words":
            if line is not None:
                line.word_ends += [w["end_ms"] * RATE // 1000 for w in message["words"]]
            self.to_agent(message)
        elif kind == "utterance.interrupted":
            report = {**message, "by": line.by if line is not None else "agent"}
            if line is not None:
                line.report = report
                self._stop(line, "interrupted")
            self.to_agent(report)
            if self.webhook_url is not None:
                payload = interruption_payload(report, self.call_sid, call_sid=self.call_sid)
                self.webhooks.submit(self.webhook_url, "utterance.interrupted", payload)
        elif kind == "utterance.paused":
            if line is not None:
                line.paused = True
            self.to_agent({**message, "by": line.by if line is not None else "agent"})
        elif kind == "utterance.unpaused":
            if line is not None:
                line.paused, line.fence = False, None
                self._wake.set()
            self.to_agent(message)
        elif kind == "error":
            self.to_agent(message)

    def _hold(self, action: Hold) -> list[Action]:
        """A pause: the line's queued frames, and after a clear the frames sent from the fence on,
        go back to the protocol (the end mark and utterance.done with them)."""
        line = self.utterances.get(action.utterance_id)
        if line is None:
            return []
        packets: list[Packet] = []
        if line.fence is not None:  # Twilio's buffer was emptied: from the fence on, again
            packets = [_from(p, line.fence) for p in line.sent if p.end_sample > line.fence]
            line.resume_from = line.fence
            line.next_mark = line.heard_index + 1
            line.all_sent = False
        queued = list(line.queue)
        packets += [p for p in queued if isinstance(p, Packet)]
        trailer = any(isinstance(p, _Done) for p in queued)
        line.queue.clear()
        line.sent.clear()
        line.anchor = None if line.fence is not None else line.anchor
        line.paused = True
        return self.protocol.held(action.utterance_id, packets, trailer)

    def _throttle(self, action: Throttle) -> None:
        line = self.utterances.get(action.utterance_id)
        if line is None:
            return
        if action.on:
            if line.gate is None:
                line.gate = asyncio.Event()
        elif line.gate is not None:
            line.gate.set()
            line.gate = None

    def _tick(self) -> None:
        if not self.ended:
            self._run(self.protocol.tick(self.loop.time()))
            self._wake.set()

    # -- engine audio -------------------------------------------------------------------------
    def _open(self, action: OpenStream) -> list[Action]:
        uid = action.utterance_id
        try:
            engine_stream = self.engine.open(action.request)
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine.open failed")
            return self.protocol.open_failed(uid, exc)
        utt = self.protocol.utterance(uid)
        assert utt is not None
        line = PhoneUtterance(uid, utt.stream, engine_stream)
        self.utterances.pop(uid, None)  # an id used again goes to the end of the line
        self.utterances[uid] = line
        self._streams[utt.stream] = line
        line.pull = self.loop.create_task(self._pull(line))
        return self.protocol.open_succeeded(uid)

    def _push(self, action: PushText) -> list[Action]:
        line = self.utterances.get(action.utterance_id)
        if line is None or not line.live:
            return []
        try:
            line.engine_stream.push(action.segment)
        except Exception as exc:
            self._stop(line, "failed")
            return self.protocol.stream_failed(action.utterance_id, exc)
        return []

    async def _pull(self, line: PhoneUtterance) -> None:
        uid = line.utterance_id
        try:
            async for chunk in line.engine_stream:
                if line.gate is not None:
                    await line.gate.wait()
                if not line.live:
                    return
                self._run(self.protocol.receive_chunk(uid, chunk))
            self._run(self.protocol.stream_ended(uid))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine stream of %s failed", uid)
            if line.live:
                self._stop(line, "failed")
                self._run(self.protocol.stream_failed(uid, exc))

    # -- the end ------------------------------------------------------------------------------
    def end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.end_reason = reason
        for line in self.utterances.values():
            if line.live:
                self._stop(line, "failed")
        self._run(self.protocol.abort())
        self.to_agent({"type": "call.ended", "call_sid": self.call_sid, "reason": reason})
        self._to_agent.put_nowait(None)
        self._wake.set()
        self._done.set()


# -- the endpoints ----------------------------------------------------------------------------


class TwilioGateway:
    """The calls in progress, by callSid, and the two WebSocket endpoints. With a `router`
    (several replicas behind one front) the call directory is kept in Redis and a control channel
    for a call held elsewhere is relayed to its owner."""

    def __init__(
        self,
        engine: Engine,
        config: GatewayConfig,
        webhooks: WebhookSender,
        options: TwilioOptions | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.webhooks = webhooks
        self.options = options or TwilioOptions()
        self.calls: dict[str, Call] = {}
        self.router: CallRouter | None = None

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/twilio", self.media_stream),
            WebSocketRoute("/v1/twilio/control/{call_sid}", self.control),
        ]

    def _call(self, call_sid: str) -> Call:
        call = self.calls.get(call_sid)
        if call is None or call.ended:
            call = Call(call_sid, self.engine, self.config, self.options, self.webhooks)
            self.calls[call_sid] = call
        return call

    def owned(self, call_sid: str) -> Call | None:
        """The live call whose media stream this replica holds."""
        call = self.calls.get(call_sid)
        return call if call is not None and call.twilio is not None and not call.ended else None

    def _forget(self, call: Call) -> None:
        if self.calls.get(call.call_sid) is call and call.twilio is None and call.agent is None:
            del self.calls[call.call_sid]

    async def media_stream(self, websocket: WebSocket) -> None:
        await websocket.accept()
        loop = asyncio.get_running_loop()
        call: Call | None = None
        writer: asyncio.Task[None] | None = None
        try:
            while True:
                text = await websocket.receive_text()
                try:
                    message = json.loads(text)
                except ValueError:
                    continue
                if not isinstance(message, dict):
                    continue
                if call is None:
                    if message.get("event") != "start":
                        continue  # `connected` (and anything before start)
                    call_sid = str(
                        (message.get("start") or {}).get("callSid") or message.get("streamSid") or ""
                    )
                    call = self._call(call_sid)
                    if call.twilio is not None:
                        call = None
                        await websocket.close(CLOSE_POLICY, "this call already has a media stream")
                        return
                    call.twilio = websocket
                    call.on_start(message)
                    writer = loop.create_task(call.write_twilio(websocket))
                    if self.router is not None:
                        self.router.call_started(call_sid)
                    continue
                call.on_twilio(message, loop.time())
                if call.ended:
                    break
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            if call is not None:
                call.end("disconnected")
                call.twilio = None
                self._forget(call)
                if self.router is not None:
                    self.router.call_ended(call.call_sid, call.end_reason or "disconnected")
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await writer
            if websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await websocket.close()

    async def control(self, websocket: WebSocket) -> None:
        await websocket.accept()
        call_sid = str(websocket.path_params["call_sid"])
        if self.router is not None and self.owned(call_sid) is None:
            await self.router.serve_agent(websocket, call_sid)  # held elsewhere, or not yet started
            return
        call = self._call(call_sid)
        if call.agent is not None:
            await websocket.close(CLOSE_POLICY, "this call already has an agent")
            return
        call.attach_agent(websocket)
        try:
            await self.run_agent(call, websocket, lambda: next_agent_frame(websocket))
        finally:
            if websocket.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await websocket.close()

    async def run_agent(
        self, call: Call, sink: AgentSink, next_frame: Callable[[], Awaitable[AgentFrame]]
    ) -> None:
        """Serve an agent already attached to `call` (`call.attach_agent(sink)`): its frames go to
        the call, the call's events to `sink`, until either side is done."""
        loop = asyncio.get_running_loop()
        writer = loop.create_task(call.write_agent(sink))
        reader = loop.create_task(self._read_agent(call, next_frame))
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if call.agent is sink:
                call.agent = None
            self._forget(call)

    async def _read_agent(self, call: Call, next_frame: Callable[[], Awaitable[AgentFrame]]) -> None:
        while True:
            frame = await next_frame()
            if frame is None:
                return
            if isinstance(frame, str):
                call.on_agent(frame)
            else:
                call._error("binary_not_supported", "binary frames from the agent are not accepted")

    async def close(self) -> None:
        for call in list(self.calls.values()):
            call.end("server shutting down")


async def next_agent_frame(websocket: WebSocket) -> AgentFrame:
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        return None
    if message.get("text") is not None:
        return str(message["text"])
    return bytes(message.get("bytes") or b"")
