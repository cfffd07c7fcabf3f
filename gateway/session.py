"""One WebSocket session: the asyncio glue around the sans-I/O SessionProtocol.

Tasks: a reader (client frames -> protocol), a writer (send queue -> socket, with pacing), a
ticker (timeouts, the slow-client watchdog), and one pull task per utterance (engine chunks ->
protocol). A client that reads nothing fills only its own queue: past the high watermark its
utterances stop pulling engine audio (the engine never waits), and when one send to the socket
has been blocked for `slow_client_timeout_s` (the client takes no bytes), or the control lane
passes `control_queue_max`, the session is closed with 1008 and its engine streams are cancelled.
Time the writer spends idle, pacing, or waiting for a busy event loop is not a stall: only a send
that the transport does not accept counts. Everything the protocol asks for runs in `_execute`,
synchronously on the event loop, so a cancel's purge of queued audio and its
`utterance.interrupted` happen together: no packet of that stream is sent after the fence.

One path takes frames off the send queue (gateway.send_queue; `Session._take`: control first,
audio in order, realtime pacing). One `Pacer` per event loop (gateway.pacer) pumps every session
with news once per loop pass, and wakes sessions whose paced audio falls due with one shared
timer. Under uvicorn (gateway.server) the
socket offers a direct frame writer: the pump writes everything that may go now in one transport
write, synchronously. Without it (tests, other servers) the pump wakes the writer task, which
sends the same frames, in the same order, one ASGI `send` each. The writer task also closes the
socket, and waits out a transport that takes no more bytes (the watchdog times that wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Protocol

from starlette.websockets import WebSocket, WebSocketState

from engine.api import AudioChunk, Engine, EngineError, SynthesisStream
from gateway.config import GatewayConfig
from gateway.errors import CLOSE_GOING_AWAY, CLOSE_POLICY
from gateway.messages import encode
from gateway.metrics import GatewayMetrics
from gateway.pacer import CLOCK_SLACK_S, Pacer
from gateway.packets import Packet
from gateway.protocol import (
    Action,
    CancelStream,
    Close,
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
    Unhold,
    WakeAt,
)
from gateway.quotas import Quotas
from gateway.send_queue import CloseItem, SendQueue, TrailerItem
from gateway.stream_listener import StreamListener

log = logging.getLogger("cadence.session")

FRAME_WRITER: Final = "cadence.frame_writer"  # the ASGI scope extension that carries a FrameWriter
_ALL: Final = sys.maxsize  # `_take` without a limit


class FrameWriter(Protocol):
    """Writes WebSocket messages straight to the connection (gateway.server.DirectFrameWriter)."""

    @property
    def open(self) -> bool: ...

    @property
    def writable(self) -> bool: ...

    async def wait_writable(self) -> None: ...

    def write(self, messages: Iterable[bytes | str]) -> None: ...


@dataclass(slots=True)
class _UtteranceClock:
    """An utterance's timings, from its first text until its trailer is sent (a pause may hold the
    trailer back past its stream's end, and queue it again at the unpause)."""

    first_text_at: float | None = None  # None: its text is still held (no segment pushed yet)
    queue_wait_s: float = 0.0  # its stream's wait for admission, kept once the stream has ended
    # its utterance.done is counted in the RTF: queued again at an unpause, it counts nothing more
    rtf_counted: bool = False


class Session:
    def __init__(
        self,
        websocket: WebSocket,
        engine: Engine,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        session_id: str | None = None,
        *,
        key_id: str = "anonymous",
        allowed_voices: frozenset[str] | None = None,
        voice_usable: Callable[[str], bool] | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        self.websocket = websocket
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.session_id = session_id or uuid.uuid4().hex[:16]
        self._loop = asyncio.get_running_loop()
        self.protocol = SessionProtocol(
            self.session_id,
            engine.info,
            config,
            key_id=key_id,
            allowed_voices=allowed_voices,
            voice_usable=voice_usable,
            quotas=quotas,
            now=self._loop.time(),
        )
        scope = getattr(websocket, "scope", None) or {}
        self._writer: FrameWriter | None = scope.get("extensions", {}).get(FRAME_WRITER)
        self._pacer = Pacer.of(self._loop)
        self._writer_needed = asyncio.Event()  # the pump needs the writer task
        self._unsendable: str | None = None  # a text frame only the ASGI send may try (it raises)
        self._closing = False
        self.paced_tick: float | None = None  # the Pacer tick this session waits for
        self.pacing_tick_s = config.pacing_tick_ms / 1000.0
        self.queue = SendQueue(
            config.send_queue_high, config.send_queue_low, functools.partial(self._pacer.pump_soon, self)
        )
        self.close_reason: tuple[int, str] | None = None  # set when the server ends the session
        self._send_started: float | None = None  # when the send in progress began (None: not sending)
        self._streams: dict[str, SynthesisStream] = {}
        self._listeners: dict[str, StreamListener] = {}  # streams that hand their chunks over
        self._pulls: dict[str, asyncio.Task[None]] = {}  # streams iterated by a task
        self._clocks: dict[str, _UtteranceClock] = {}  # from the first text until the trailer is sent
        self._stream_t0: dict[int, float] = {}  # pacing: when sample 0 of the stream is due
        self._throttled: dict[str, asyncio.Event] = {}  # iterated streams held back (set: go on)
        self._counted_active = 0
        self._idle = asyncio.Event()
        self._done = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the (already accepted) socket until either side closes it."""
        self.metrics.active_sessions.inc()
        reader = asyncio.create_task(self._read_loop())
        writer = asyncio.create_task(self._write_loop())
        ticker = asyncio.create_task(self._tick_loop())
        tasks = (reader, writer, ticker)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._stop_all_streams()
            if self.close_reason is not None:  # the writer may be stuck: close without waiting long
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._close_socket(CloseItem(*self.close_reason)), 1.0)
            self.metrics.active_sessions.dec()
            self.metrics.active_utterances.dec(self._counted_active)
            self._counted_active = 0
            self.queue.detach()
            self._done.set()

    async def shutdown(self, drain_timeout_s: float) -> None:
        """Refuse new utterances, let open ones finish (bounded), then close with 1001."""
        self.protocol.begin_shutdown()
        if self.protocol.active_count:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        self._execute(self.protocol.abort(CLOSE_GOING_AWAY, "server shutting down"))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._done.wait(), 2.0)

    def queued_bytes(self) -> int:
        return self.queue.queued_bytes()

    def inject(self, text: str) -> None:
        """A client message that arrived another way (cross-replica control): handled as if read
        from this session's socket."""
        self._execute(self.protocol.receive_text(text, self._loop.time()))

    # -- ticker -------------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        """Protocol timeouts and the slow-client watchdog, once a second; returns to end the session."""
        period = min(1.0, self.config.slow_client_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = self._loop.time()
            self._execute(self.protocol.tick(now))
            reason = self.too_slow(now)
            if reason is not None:
                self._end(CLOSE_POLICY, reason)
                return

    def too_slow(self, now: float) -> str | None:
        """Why the client counts as a stalled reader at `now`, or None while it is not one."""
        stalled = self.send_blocked_for(now)
        if stalled > self.config.slow_client_timeout_s:
            return f"client too slow: a send blocked for {stalled:.0f} s"
        if len(self.queue.control) > self.config.control_queue_max:
            return "client too slow: too many messages queued"
        return None

    def send_blocked_for(self, now: float) -> float:
        """Seconds the send in progress has waited for the client to take bytes (0 when not sending)."""
        return 0.0 if self._send_started is None else now - self._send_started

    def _end(self, code: int, reason: str) -> None:
        log.info("session %s closed: %s", self.session_id, reason)
        self.metrics.errors.labels("slow_client").inc()
        self.close_reason = (code, reason)
        self.queue.control.clear()
        self.queue.audio.clear()

    # -- reader -------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                return
            now = self._loop.time()
            text, data = message.get("text"), message.get("bytes")
            if text is not None:
                self._execute(self.protocol.receive_text(text, now))
            elif data is not None:
                self._execute(self.protocol.receive_binary(data))

    # -- writer -------------------------------------------------------------------------------
    def pump(self) -> int:
        """Send what may go now (`_take`). On the direct path: in ONE transport write, here and now;
        returns how many packets went (the caller counts them). It writes nothing at a close, or
        while the transport takes no more bytes: the writer task does what waits. On the ASGI path
        the writer task sends, frame by frame: it is woken."""
        writer = self._writer
        if writer is None:
            self._writer_needed.set()
            return 0
        if self._closing or self.close_reason is not None or not writer.open:
            return 0  # a closed socket: the reader sees the disconnect and ends the session
        if not writer.writable:
            self._writer_needed.set()
            return 0
        frames: list[bytes | str] = []
        packets = self._take(frames, _ALL)
        if frames:
            writer.write(frames)
        if self.queue.control or self._unsendable is not None:
            self._writer_needed.set()
        return packets

    async def _write_loop(self) -> None:
        """The writer task, for what cannot be done without waiting: on the ASGI path it sends every
        frame (one `send` each, and one taken at a time, so that a purge still reaches the frames
        behind it); on both paths it closes the socket, and it waits out a transport that takes no
        more bytes (the watchdog times a send, and that wait)."""
        writer = self._writer
        while True:
            self._writer_needed.clear()
            if writer is None:
                frames: list[bytes | str] = []
                packets = self._take(frames, 1)
                if frames:
                    await self._send(frames[0])
                    if packets:
                        self.metrics.packets.inc(packets)
                    continue
            else:
                self._pump_counted()
            if self._unsendable is not None:  # the ASGI send raises for it, which ends the session
                text, self._unsendable = self._unsendable, None
                await self._send(text)
                continue
            control = self.queue.control
            if control and isinstance(close := control[0], CloseItem):
                self._closing = True
                control.popleft()
                await self._close_socket(close)
                return
            if writer is not None and writer.open and not writer.writable:
                self._send_started = self._loop.time()
                try:
                    await writer.wait_writable()
                finally:
                    self._send_started = None
                continue
            await self._writer_needed.wait()

    def _pump_counted(self) -> None:
        packets = self.pump()
        if packets:
            self.metrics.packets.inc(packets)

    def _due_at(self, stream: int, packet: Packet) -> float | None:
        """When a realtime-paced packet may go (loop time); None when it may go now."""
        if self.protocol.pacing != "realtime":
            return None
        t0 = self._stream_t0.get(stream)
        if t0 is None:
            return None
        lead = self.config.realtime_lead_ms / 1000.0
        return t0 + packet.sample_offset / self.protocol.output.sample_rate - lead

    def _take(self, frames: list[bytes | str], most: int) -> int:
        """Move up to `most` frames that may go now into `frames`: every control message first, then
        the audio lane in order, up to paced audio not yet due (the Pacer's next tick takes that).
        Stops at a close, and at text that is not valid UTF-8 (both the writer task's).
        What is taken counts as sent: the protocol is told now, and the caller sends `frames` before
        anything else. Returns how many packets were taken."""
        if self._unsendable is not None:  # nothing goes after it
            return 0
        control, audio = self.queue.control, self.queue.audio
        now = self._loop.time()
        protocol = self.protocol
        paced = protocol.pacing == "realtime"
        if paced:  # _due_at, inlined: a packet may go `lead` before it is due on its stream's clock,
            # judged at the last tick of the grid, so that between ticks only late audio goes (the
            # tick sends the rest together: one write for every packet it finds due)
            t0s, rate = self._stream_t0, protocol.output.sample_rate
            grid = self.pacing_tick_s
            tick = math.floor((now + CLOCK_SLACK_S) / grid) * grid
            horizon = tick + self.config.realtime_lead_ms / 1000.0 + CLOCK_SLACK_S
        packet_sent = protocol.packet_sent
        latest: dict[int, Packet] = {}
        packets = 0
        while len(frames) < most:
            if control and not isinstance(control[0], CloseItem):
                if not self._take_text(control.popleft(), frames):
                    break
                continue
            if control or not audio:  # a close, or nothing more
                break
            item = audio[0]
            stream = item.stream
            if type(item) is TrailerItem:
                audio.popleft()
                if not self._take_text(item.text, frames):
                    break
                utt = self.protocol.by_stream(stream)
                if utt is not None:  # delivered: its first packet went out before its trailer
                    self._clocks.pop(utt.utterance_id, None)
                self._execute(self.protocol.trailer_sent(stream))
                continue
            assert isinstance(item, Packet)
            if paced and (t0 := t0s.get(stream)) is not None and t0 + item.sample_offset / rate > horizon:
                due = self._due_at(stream, item)
                assert due is not None
                if self.paced_tick is None or self.paced_tick > due:
                    self.paced_tick = self._pacer.wake_at(self, due)
                break
            audio.popleft()
            frames.append(item.frame)
            packets += 1
            if item.seq == 0 or item.flags:  # a stream's first or last packet: its bookkeeping
                self._after_packet_sent(stream, item, now)
            else:  # the others: only the latest of each stream counts (protocol.packet_sent)
                latest[stream] = item
        for stream, item in latest.items():
            if actions := packet_sent(stream, item, now):
                self._execute(actions)
        self.queue.after_take()
        return packets

    def _take_text(self, text: str | CloseItem, frames: list[bytes | str]) -> bool:
        """Add a text frame; one that is not valid UTF-8 is set aside for the writer task."""
        assert isinstance(text, str)
        try:
            text.encode()
        except UnicodeEncodeError:
            self._unsendable = text
            return False
        frames.append(text)
        return True

    async def _send(self, frame: str | bytes) -> None:
        """One frame to the socket; the watchdog times how long the transport takes to accept it."""
        self._send_started = self._loop.time()
        try:
            if isinstance(frame, str):
                await self.websocket.send_text(frame)
            else:
                await self.websocket.send_bytes(frame)
        finally:
            self._send_started = None

    def _after_packet_sent(self, stream: int, packet: Packet, now: float) -> None:
        if packet.seq == 0:
            self._stream_t0[stream] = now
            utt = self.protocol.by_stream(stream)
            clock = self._clocks.get(utt.utterance_id) if utt else None
            if clock is not None and clock.first_text_at is not None and utt is not None:  # from admission
                waited = self._queue_wait(utt.utterance_id)
                self.metrics.ttfa.labels("stream").observe(now - clock.first_text_at - waited)
        if packet.last:
            self._stream_t0.pop(stream, None)
        actions = self.protocol.packet_sent(stream, packet, now)
        if actions:
            self._execute(actions)

    async def _close_socket(self, item: CloseItem) -> None:
        if self.websocket.application_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.websocket.close(item.code, item.reason)

    # -- engine pulls -------------------------------------------------------------------------
    async def _pull(self, utterance_id: str, stream: SynthesisStream) -> None:
        """A stream that cannot hand its chunks over (SynthesisStream.listen), iterated."""
        writable = self.queue.writable
        try:
            async for chunk in stream:
                if not writable.is_set():
                    await writable.wait()
                if (gate := self._throttled.get(utterance_id)) is not None:
                    await gate.wait()
                self._take_chunk(utterance_id, chunk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine failure ends this utterance only
            self._stream_failed(utterance_id, exc)
        else:
            self._stream_ended(utterance_id)
        finally:
            self._pulls.pop(utterance_id, None)

    def _stream_ended(self, utterance_id: str) -> None:
        actions = self.protocol.stream_ended(utterance_id)
        self._execute(actions)  # its utterance.done, while the stream still tells its queue wait
        utt = self.protocol.utterance(utterance_id)
        if utt is not None and utt.status.active:  # its trailer is still to be sent
            waited = self._queue_wait(utterance_id)
            self._clocks.setdefault(utterance_id, _UtteranceClock()).queue_wait_s = waited
        self._streams.pop(utterance_id, None)
        self._listeners.pop(utterance_id, None)

    def _stream_failed(self, utterance_id: str, exc: BaseException) -> None:
        if not isinstance(exc, EngineError):
            log.error("engine stream of %s failed", utterance_id, exc_info=exc)
        # cancelled: when the session is what failed (a chunk it could not take), the engine would
        # go on making audio for nobody
        self._cancel_stream(utterance_id)
        self._execute(self.protocol.stream_failed(utterance_id, exc))

    def _take_chunk(self, utterance_id: str, chunk: AudioChunk) -> None:
        """A chunk's packets straight into the audio lane, the rest (words, a trailer) in order. A
        method of its own: its actions die with it instead of living in `_pull`'s frame until the
        next chunk comes (seconds, with packets waiting in the lane meanwhile)."""
        actions = self.protocol.receive_chunk(utterance_id, chunk)
        if len(actions) == 1 and type(action := actions[0]) is SendAudio:  # the common case: audio alone
            self.queue.put_audio(action.packets)
        else:
            self._execute(actions)

    def _stop_all_streams(self) -> None:
        for utterance_id in list(self._streams):
            self._cancel_stream(utterance_id)

    def _cancel_stream(self, utterance_id: str) -> None:
        gate = self._throttled.pop(utterance_id, None)
        if gate is not None:
            gate.set()
        listener = self._listeners.pop(utterance_id, None)
        if listener is not None:
            listener.close()
        stream = self._streams.pop(utterance_id, None)
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.cancel()
        task = self._pulls.pop(utterance_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    # -- running the protocol's actions -------------------------------------------------------
    def _execute(self, actions: list[Action]) -> None:
        pending = deque(actions)
        while pending:
            action = pending.popleft()
            if type(action) is SendAudio:  # the common case first
                self.queue.put_audio(action.packets)
            elif isinstance(action, SendControl):
                if action.message["type"] == "error":
                    self.metrics.errors.labels(action.message["code"]).inc()
                self.queue.put_control(encode(action.message))
            elif isinstance(action, SendTrailer):
                self._observe_rtf(action)
                self.queue.put_trailer(action.stream, encode(action.message))
            elif isinstance(action, Purge):
                self.queue.purge(action.stream)
                self._stream_t0.pop(action.stream, None)
            elif isinstance(action, OpenStream):
                pending.extend(self._open(action))
            elif isinstance(action, PushText):
                pending.extend(self._push(action))
            elif isinstance(action, CloseText):
                stream = self._streams.get(action.utterance_id)
                if stream is not None:
                    try:
                        stream.close_text()
                    except Exception as exc:  # fails this utterance only, as a failed push does
                        self._cancel_stream(action.utterance_id)
                        pending.extend(self.protocol.stream_failed(action.utterance_id, exc))
            elif isinstance(action, CancelStream):
                self._cancel_stream(action.utterance_id)
                self._clocks.pop(action.utterance_id, None)
            elif isinstance(action, Close):
                self.queue.put_control(CloseItem(action.code, action.reason))
            elif isinstance(action, Hold | Unhold | Throttle | WakeAt):
                pending.extendleft(reversed(self._pause_action(action)))
        self._count_active()

    def _pause_action(self, action: Hold | Unhold | Throttle | WakeAt) -> list[Action]:
        """speak.pause / unpause: the send lane, the pacing clock, the engine pull, the deadline."""
        if isinstance(action, Hold):
            packets, trailer = self.queue.withdraw(action.stream)
            return self.protocol.held(action.utterance_id, packets, trailer)
        if isinstance(action, Unhold):
            if action.stream in self._stream_t0:  # paced: the listener is at played_samples now
                rate = self.protocol.output.sample_rate
                self._stream_t0[action.stream] = self._loop.time() - action.played_samples / rate
        elif isinstance(action, Throttle):
            listener = self._listeners.get(action.utterance_id)
            if listener is not None:
                listener.throttle(action.on)
            elif action.on:
                self._throttled.setdefault(action.utterance_id, asyncio.Event())
            elif (gate := self._throttled.pop(action.utterance_id, None)) is not None:
                gate.set()
        else:
            self._loop.call_at(action.at, self._wake)
        return []

    def _wake(self) -> None:
        if not self._done.is_set():
            self._execute(self.protocol.tick(self._loop.time()))

    def _open(self, action: OpenStream) -> list[Action]:
        try:
            stream = self.engine.open(action.request)
        except Exception as exc:
            if not isinstance(exc, EngineError):
                log.exception("engine.open failed")
            return self.protocol.open_failed(action.utterance_id, exc)
        self._streams[action.utterance_id] = stream
        self.metrics.utterances.labels("stream").inc()
        uid = action.utterance_id
        listener = StreamListener(
            functools.partial(self._take_chunk, uid),
            functools.partial(self._stream_ended, uid),
            functools.partial(self._stream_failed, uid),
            self.queue.writable,
        )
        if stream.listen(listener):
            self._listeners[uid] = listener
        else:
            self._pulls[uid] = asyncio.create_task(self._pull(uid, stream))
        return self.protocol.open_succeeded(action.utterance_id, stream.queue_position())

    def _push(self, action: PushText) -> list[Action]:
        stream = self._streams.get(action.utterance_id)
        if stream is None:
            return []
        clock = self._clocks.get(action.utterance_id)
        if clock is None:
            self._clocks[action.utterance_id] = _UtteranceClock(self._loop.time())
        elif clock.first_text_at is None:
            clock.first_text_at = self._loop.time()
        try:
            stream.push(action.segment)
        except Exception as exc:
            self._cancel_stream(action.utterance_id)
            return self.protocol.stream_failed(action.utterance_id, exc)
        return []

    def _observe_rtf(self, action: SendTrailer) -> None:
        message = action.message
        if message["type"] != "utterance.done":
            return
        waited = self._queue_wait(message["utterance_id"])
        if waited > 0:
            message["queued_ms"] = round(1000 * waited)
        # kept until the trailer is sent: the first packet may still be queued ahead of it
        clock = self._clocks.get(message["utterance_id"])
        if (
            clock is not None
            and clock.first_text_at is not None
            and message["duration_ms"] > 0
            and not clock.rtf_counted
        ):
            clock.rtf_counted = True
            self.metrics.rtf.labels("stream").observe(
                (self._loop.time() - clock.first_text_at - waited) / (message["duration_ms"] / 1000)
            )

    def _queue_wait(self, utterance_id: str) -> float:
        """Seconds the utterance's engine stream waited for admission (0: admitted at once)."""
        stream = self._streams.get(utterance_id)
        if stream is not None:
            return stream.queue_wait_s()
        clock = self._clocks.get(utterance_id)
        return 0.0 if clock is None else clock.queue_wait_s

    def _count_active(self) -> None:
        active = self.protocol.active_count
        if active != self._counted_active:
            self.metrics.active_utterances.inc(active - self._counted_active)
            self._counted_active = active
        if active == 0:
            self._clocks.clear()  # a failed utterance sends no trailer to pop its entry
            self._idle.set()
