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
vocabulary (session.start, speak.append / flush / end / cancel) and hears back the call's events.
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

from engine.api import AudioChunk, Engine, EngineError, SynthesisRequest, SynthesisStream, float_samples
from gateway.config import GatewayConfig
from gateway.errors import error_code, public_message
from gateway.messages import (
    ProtocolError,
    SessionEnd,
    SessionStart,
    SpeakAppend,
    SpeakCancel,
    SpeakEnd,
    SpeakFlush,
    Word,
    decode,
    encode,
)
from gateway.packets import OutputFormat, Packet, Packetiser, mulaw_decode
from gateway.segmenter import Segmenter
from gateway.webhooks import WebhookSender, interruption_payload

log = logging.getLogger("cadence.twilio")

RATE: Final = 8000
FRAME_MS: Final = 20
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


@dataclass(eq=False, slots=True)
class PhoneUtterance:
    utterance_id: str
    request: SynthesisRequest
    segmenter: Segmenter
    packetiser: Packetiser
    engine_rate: int
    text: str = ""
    stream: SynthesisStream | None = None
    pull: asyncio.Task[None] | None = None
    words: list[Word] = field(default_factory=list)
    word_ends: list[int] = field(default_factory=list)  # each word's end, in 8 kHz samples
    packets: deque[Packet] = field(default_factory=deque)
    text_closed: bool = False
    generated: bool = False  # the last packet is made
    all_sent: bool = False  # the last packet and the end mark are sent
    state: Literal["active", "played", "interrupted", "failed"] = "active"
    sent_samples: int = 0
    next_mark: int = 0  # the next word to mark
    heard_index: int = -1  # the last word whose mark came back before any clear
    heard_samples: int = 0  # where that mark sat (8 kHz samples)
    heard_at: float | None = None
    first_sent_at: float | None = None
    report: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.state == "active"


def mark_name(utterance_id: str, index: int | None) -> str:
    return f"{utterance_id}/end" if index is None else f"{utterance_id}/w{index}"


@dataclass(frozen=True, slots=True)
class _Mark:
    utterance: PhoneUtterance
    index: int | None  # the word, or None: the utterance's end
    position: int  # 8 kHz samples of the utterance played when it comes back


# -- the call ---------------------------------------------------------------------------------


class Call:
    """One phone call: the Twilio socket, the agent's socket (either may come first) and the
    utterances being spoken on the line, in order."""

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
        self.stream_sid: str | None = None
        self.start_info: dict[str, Any] = {}
        self.twilio: WebSocket | None = None
        self.agent: AgentSink | None = None
        self.ended = False
        self.end_reason: str | None = None
        self.voice: str | None = None
        self.language = "Auto"
        self.instructions: str | None = None
        self.webhook_url: str | None = None
        self.utterances: dict[str, PhoneUtterance] = {}
        self.vad = EnergyVad(options.vad_threshold_dbfs, options.vad_attack_ms, options.vad_hang_ms)
        self._marks: dict[str, _Mark] = {}  # sent, not yet back, not voided by a clear
        self._to_twilio: deque[dict[str, Any]] = deque()  # control (clear), ahead of media
        self._to_agent: asyncio.Queue[str | None] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._done = asyncio.Event()
        self.sequence = 0

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
        self.voice = params.get("voice") or self.voice
        self.language = params.get("language") or self.language
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
            if self.options.barge_in_on_speech and any(u.active for u in self.utterances.values()):
                self.interrupt(None, "caller", now)
        elif change == "stop":
            self.to_agent({"type": "speech.stopped"})

    def _on_mark(self, name: str, now: float) -> None:
        mark = self._marks.pop(name, None)
        if mark is None:
            return  # voided by a clear, or not ours
        utt = mark.utterance
        utt.heard_samples, utt.heard_at = mark.position, now
        if mark.index is not None:
            utt.heard_index = max(utt.heard_index, mark.index)
        elif utt.active:
            utt.state = "played"
            self.to_agent({"type": "utterance.played", "utterance_id": utt.utterance_id})

    async def write_twilio(self, websocket: WebSocket) -> None:
        """The one writer of the Twilio socket: clears first, then the utterances' media in order."""
        while not self.ended:
            if self.stream_sid is None:
                await self._sleep()
                continue
            if self._to_twilio:
                await websocket.send_text(encode(self._to_twilio.popleft()))
                continue
            utt = self._playing()
            if utt is None or not utt.packets:
                await self._sleep()
                continue
            packet = utt.packets.popleft()
            await websocket.send_text(encode(self._twilio_message("media", payload=packet.payload)))
            if utt.active and not self._to_twilio:
                for message in self._after_packet(utt, packet):
                    await websocket.send_text(encode(message))

    async def _sleep(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _playing(self) -> PhoneUtterance | None:
        """The utterance whose audio goes on the line now: the first active one not fully sent."""
        for utt in self.utterances.values():
            if utt.active and not utt.all_sent:
                return utt
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

    def _after_packet(self, utt: PhoneUtterance, packet: Packet) -> list[dict[str, Any]]:
        """Bookkeeping after a media frame went out; the marks that follow it."""
        if utt.first_sent_at is None:
            utt.first_sent_at = self.loop.time()
        utt.sent_samples = packet.end_sample
        out = []
        while utt.next_mark < len(utt.words) and (
            packet.last or utt.word_ends[utt.next_mark] <= packet.end_sample
        ):
            out.append(self._mark(utt, utt.next_mark, packet.end_sample))
            utt.next_mark += 1
        if packet.last:
            out.append(self._mark(utt, None, packet.end_sample))
            utt.all_sent = True
            self.to_agent(
                {
                    "type": "utterance.done",
                    "utterance_id": utt.utterance_id,
                    "duration_ms": utt.packetiser.duration_ms,
                }
            )
        return out

    def _mark(self, utt: PhoneUtterance, index: int | None, position: int) -> dict[str, Any]:
        name = mark_name(utt.utterance_id, index)
        self._marks[name] = _Mark(utt, index, position)
        return self._twilio_message("mark", name=name)

    # -- barge-in -----------------------------------------------------------------------------
    def interrupt(self, utterance_id: str | None, by: BargeInBy, now: float) -> None:
        """Stop `utterance_id` (None: every active one); clear Twilio's buffer when it holds audio
        of it (which stops every utterance with audio there) and report what was heard."""
        active = [u for u in self.utterances.values() if u.active]
        if utterance_id is None:
            targets = active
        else:
            target = self.utterances.get(utterance_id)
            if target is None:
                raise ProtocolError("unknown_utterance", f"no utterance {utterance_id!r}", utterance_id)
            if not target.active:
                if target.report is not None:
                    self.to_agent(target.report)
                return
            targets = [target]
        buffered = [u for u in active if u.sent_samples > 0]
        if any(u.sent_samples > 0 for u in targets):
            targets = list(dict.fromkeys(targets + buffered))
            self._to_twilio.append(self._twilio_message("clear"))
        reports = [self._report(u, by, now) for u in targets]  # from marks back before this clear
        voided = {u.utterance_id for u in targets}
        self._marks = {k: m for k, m in self._marks.items() if m.utterance.utterance_id not in voided}
        for utt, report in zip(targets, reports, strict=True):
            self._stop(utt, "interrupted")
            utt.report = report
            self.to_agent(report)
            if self.webhook_url is not None:
                payload = interruption_payload(report, self.call_sid, call_sid=self.call_sid)
                self.webhooks.submit(self.webhook_url, "utterance.interrupted", payload)
        self._wake.set()

    def _report(self, utt: PhoneUtterance, by: BargeInBy, now: float) -> dict[str, Any]:
        played = self._played_samples(utt, now)
        played_ms = played * 1000 // RATE
        last = utt.words[utt.heard_index] if utt.heard_index >= 0 else None
        partial = next(
            (w for w in utt.words[utt.heard_index + 1 :] if w.start_ms <= played_ms < w.end_ms), None
        )
        split = last.char_end if last is not None else 0
        return {
            "type": "utterance.interrupted",
            "utterance_id": utt.utterance_id,
            "played_ms": played_ms,
            "position_source": "marks",
            "last_word": last.to_wire() if last else None,
            "partial_word": partial.to_wire() if partial else None,
            "spoken_text": utt.text[:split],
            "unspoken_text": utt.text[split:],
            "by": by,
        }

    def _played_samples(self, utt: PhoneUtterance, now: float) -> int:
        """Between the last mark back and the next one out: extrapolated at real time from the
        last mark's return (or from the first frame sent), capped at the next mark's place."""
        if utt.first_sent_at is None:
            return 0
        base, since = (
            (utt.heard_samples, utt.heard_at) if utt.heard_at is not None else (0, utt.first_sent_at)
        )
        cap = min([m.position for m in self._marks.values() if m.utterance is utt] + [utt.sent_samples])
        estimate = base + int(max(0.0, now - since) * RATE)
        return max(base, min(estimate, cap))

    def _stop(self, utt: PhoneUtterance, state: Literal["interrupted", "failed", "played"]) -> None:
        utt.state = state
        utt.packets.clear()
        if utt.stream is not None:
            with contextlib.suppress(Exception):
                utt.stream.cancel()
        if utt.pull is not None and utt.pull is not asyncio.current_task():
            utt.pull.cancel()

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
            if isinstance(message, SessionStart):
                self.voice = message.voice or self.voice
                self.language = message.language or self.language
                self.instructions = message.instructions or self.instructions
                self.webhook_url = message.webhook_url or self.webhook_url
            elif isinstance(message, SpeakAppend):
                self._append(message)
            elif isinstance(message, SpeakFlush | SpeakEnd):
                self._flush(message.utterance_id, close=isinstance(message, SpeakEnd))
            elif isinstance(message, SpeakCancel):
                self.interrupt(message.utterance_id, "agent", self.loop.time())
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

    def _append(self, message: SpeakAppend) -> None:
        uid = message.utterance_id
        utt = self.utterances.get(uid)
        if utt is None:
            if sum(u.active for u in self.utterances.values()) >= self.config.max_open_utterances:
                raise ProtocolError("too_many_utterances", "too many utterances waiting on this call", uid)
            utt = self._open(uid)
            if utt is None:
                return
        elif not utt.active or utt.text_closed:
            raise ProtocolError("utterance_closed", f"utterance {uid!r} takes no more text", uid)
        if len(utt.text) + len(message.text) > self.config.max_text_chars:
            raise ProtocolError("text_too_long", f"at most {self.config.max_text_chars} characters", uid)
        utt.text += message.text
        segments = utt.segmenter.feed(message.text) + (utt.segmenter.flush() if message.flush else [])
        self._push(utt, segments)

    def _flush(self, uid: str, close: bool) -> None:
        utt = self.utterances.get(uid)
        if utt is None:
            raise ProtocolError("unknown_utterance", f"no utterance {uid!r}", uid)
        if not utt.active or utt.text_closed:
            return
        self._push(utt, utt.segmenter.flush())
        if close and utt.stream is not None:
            utt.text_closed = True
            utt.stream.close_text()

    def _open(self, uid: str) -> PhoneUtterance | None:
        request = SynthesisRequest(
            request_id=f"twilio/{self.call_sid}/{uid}",
            voice=self.voice,
            language=self.language,
            instructions=self.instructions,
        )
        rate = self.engine.info.sample_rate
        utt = PhoneUtterance(
            uid,
            request,
            Segmenter(self.config.segment_max_chars, self.config.segment_clause_min_chars),
            Packetiser(0, OutputFormat("mulaw", RATE, FRAME_MS), rate),
            rate,
        )
        try:
            utt.stream = self.engine.open(request)
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine.open failed")
            self._error(error_code(exc), public_message(exc), uid)
            return None
        self.utterances[uid] = utt
        utt.pull = self.loop.create_task(self._pull(utt))
        self.to_agent({"type": "utterance.started", "utterance_id": uid})
        return utt

    def _push(self, utt: PhoneUtterance, segments: list[Any]) -> None:
        if utt.stream is None:
            return
        for segment in segments:
            try:
                utt.stream.push(segment)
            except Exception as exc:
                self._fail(utt, exc)
                return

    # -- engine audio -------------------------------------------------------------------------
    async def _pull(self, utt: PhoneUtterance) -> None:
        assert utt.stream is not None
        try:
            async for chunk in utt.stream:
                if not utt.active:
                    return
                self._take_chunk(utt, chunk)
            if utt.active and not utt.generated:
                self._add_packets(utt, utt.packetiser.push(np.zeros(0, np.float32), final=True))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine stream of %s failed", utt.utterance_id)
            self._fail(utt, exc)

    def _take_chunk(self, utt: PhoneUtterance, chunk: AudioChunk) -> None:
        new_words = []
        for timing in chunk.words:
            word = Word(
                len(utt.words),
                timing.text,
                round(timing.start_sample * 1000 / utt.engine_rate),
                round(timing.end_sample * 1000 / utt.engine_rate),
                timing.char_start,
                timing.char_end,
            )
            utt.words.append(word)
            utt.word_ends.append(timing.end_sample * RATE // utt.engine_rate)
            new_words.append(word.to_wire())
        if new_words:
            self.to_agent(
                {
                    "type": "words",
                    "utterance_id": utt.utterance_id,
                    "source": chunk.words[0].source,
                    "words": new_words,
                }
            )
        samples = float_samples(chunk.samples)
        self._add_packets(utt, utt.packetiser.push(samples, final=chunk.final))

    def _add_packets(self, utt: PhoneUtterance, packets: list[Packet]) -> None:
        utt.packets.extend(packets)
        if packets and packets[-1].last:
            utt.generated = True
        self._wake.set()

    def _fail(self, utt: PhoneUtterance, exc: BaseException) -> None:
        if not utt.active:
            return
        self._stop(utt, "failed")
        self._error(error_code(exc), public_message(exc), utt.utterance_id)
        self._wake.set()

    # -- the end ------------------------------------------------------------------------------
    def end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.end_reason = reason
        for utt in self.utterances.values():
            if utt.active:
                self._stop(utt, "failed")
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
