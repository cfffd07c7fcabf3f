"""A LiveKit Agents TTS that speaks through Cadence's `WS /v1/stream` (extra `cadence[livekit]`).

    from clients.livekit_plugin import CadenceTTS
    session = AgentSession(tts=CadenceTTS(url="ws://127.0.0.1:8000/v1/stream", voice="Vivian"), ...)

Streaming, with an aligned transcript: each LiveKit stream (one agent turn) is one Cadence
utterance on a socket the TTS keeps open for all its turns; LiveKit's text goes in as
`speak.append` (a flush as `speak.flush`, the end of input as `speak.end`), Cadence's audio
packets come out as PCM frames, and its `words` as LiveKit's timed transcript (`TimedString`s on
the utterance's timeline), which LiveKit's transcript synchroniser releases as the words play.
When LiveKit interrupts a turn (it closes the stream), the utterance is cancelled (`speak.cancel`);
Cadence's answer, with the last word heard and the spoken / unspoken text, goes to `on_interrupt`
and `interruptions`. For a possible false interruption (LiveKit's `resume_false_interruption`),
`pause()` fences the turn at Cadence instead (`speak.pause`: nothing more of it arrives, the rest is
kept) and `unpause()` goes on from the first sample after the fence; their reports go to
`on_pause` and `pauses`. A pause left past the session's `pause_timeout_ms` ends the turn as an
interruption. `pacing="realtime"` (the default) keeps Cadence's audio about a lead ahead of
real time, so Cadence's own estimate of what was heard is close.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Callable
from typing import Any

from livekit.agents import APIConnectionError, APIConnectOptions, APIError, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, TimedString

from clients.client import ClientError, Done, Error, Interrupted, Packet, Paused, Session, Words, connect


class CadenceTTS(tts.TTS[Any]):
    def __init__(
        self,
        *,
        url: str = "ws://127.0.0.1:8000/v1/stream",
        voice: str | None = None,
        language: str | None = None,
        instructions: str | None = None,
        token: str | None = None,
        sample_rate: int = 24_000,
        pacing: str = "realtime",
        on_interrupt: Callable[[Interrupted], object] | None = None,
        on_pause: Callable[[Paused], object] | None = None,
    ) -> None:
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=sample_rate,
            num_channels=1,
        )
        self._url = url
        self._options: dict[str, Any] = {
            "voice": voice,
            "language": language,
            "instructions": instructions,
            "token": token,
            "sample_rate": sample_rate,
            "encoding": "pcm_s16le",
            "pacing": pacing,
        }
        self._on_interrupt = on_interrupt
        self.interruptions: list[Interrupted] = []  # Cadence's reports of the interrupted turns
        self._on_pause = on_pause
        self.pauses: list[Paused] = []  # Cadence's reports of the paused turns
        self.current: str | None = None  # the utterance of the turn being spoken, if any
        self._session: Session | None = None
        self._exit = contextlib.AsyncExitStack()
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:6]

    @property
    def model(self) -> str:
        return self._session.engine.get("model", "cadence") if self._session else "cadence"

    @property
    def provider(self) -> str:
        return "Cadence"

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> CadenceStream:
        return CadenceStream(tts=self, conn_options=conn_options)

    def synthesize(
        self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
    ) -> tts.ChunkedStream:
        return self._synthesize_with_stream(text, conn_options=conn_options)

    def next_utterance_id(self) -> str:
        return f"lk-{self._prefix}-{next(self._ids)}"

    async def session(self) -> Session:
        """The open Cadence session (opened, or opened again after it was lost)."""
        async with self._lock:
            if self._session is None or self._session.closed:
                await self._exit.aclose()
                self._exit = contextlib.AsyncExitStack()
                self._session = await self._exit.enter_async_context(
                    connect(self._url, on_interrupt=self._interrupted, **self._options)
                )
            return self._session

    async def pause(self, played_ms: int | None = None) -> bool:
        """Pause the turn being spoken (its audio stops at once; the rest is kept). `played_ms`:
        what the listener heard of it, if known (else Cadence's estimate). False: no turn to pause."""
        if self.current is None or self._session is None:
            return False
        await self._session.pause(self.current, played_ms=played_ms)
        return True

    async def unpause(self) -> bool:
        """Go on with the paused turn from the first sample after the fence."""
        if self.current is None or self._session is None:
            return False
        await self._session.unpause(self.current)
        return True

    def _paused(self, report: Paused) -> None:
        self.pauses.append(report)
        if self._on_pause is not None:
            self._on_pause(report)

    def _interrupted(self, report: Interrupted) -> None:
        self.interruptions.append(report)
        if self._on_interrupt is not None:
            self._on_interrupt(report)

    async def aclose(self) -> None:
        async with self._lock:
            self._session = None
            await self._exit.aclose()


class CadenceStream(tts.SynthesizeStream):
    def __init__(self, *, tts: CadenceTTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._cadence = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        uid = self._cadence.next_utterance_id()
        output_emitter.initialize(
            request_id=uid,
            sample_rate=self._cadence.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        output_emitter.start_segment(segment_id=uid)
        try:
            session = await asyncio.wait_for(self._cadence.session(), self._conn_options.timeout)
        except (OSError, TimeoutError, ClientError) as exc:
            raise APIConnectionError(f"cannot reach Cadence: {exc}") from exc
        text = ""  # what this turn sent, for the timed transcript's pieces
        finished = False
        sent = asyncio.Event()  # the first text went, or the input ended without any
        self._cadence.current = uid

        async def send() -> None:
            nonlocal text
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if text:
                        await session.flush(uid)
                    continue
                self._mark_started()
                await session.append(uid, data)
                text += data
                sent.set()
            sent.set()
            if text:
                await session.end(uid)

        async def receive() -> None:
            nonlocal finished
            heard_to = 0  # where the previous word's piece ended in `text`
            await sent.wait()
            if not text:  # no text, so no utterance was opened: nothing will come for it
                return
            async for event in session.events(uid):
                if isinstance(event, Packet):
                    output_emitter.push(event.payload)
                elif isinstance(event, Words):
                    pieces = []
                    for word in event.words:
                        pieces.append(
                            TimedString(
                                text[heard_to : word.char_end] or word.text,
                                start_time=word.start_ms / 1000,
                                end_time=word.end_ms / 1000,
                            )
                        )
                        heard_to = max(heard_to, word.char_end)
                    output_emitter.push_timed_transcript(pieces)
                elif isinstance(event, Paused):
                    self._cadence._paused(event)
                elif isinstance(event, Done | Interrupted):
                    finished = True
                    return
                elif isinstance(event, Error) and event.ends_utterance:
                    finished = True
                    raise APIError(f"Cadence {event.code}: {event.message}")

        sender = asyncio.create_task(send(), name="cadence-livekit-send")
        receiver = asyncio.create_task(receive(), name="cadence-livekit-receive")
        try:
            await asyncio.gather(sender, receiver)
            output_emitter.end_segment()
        finally:
            if self._cadence.current == uid:
                self._cadence.current = None
            if not finished and text:  # LiveKit closed the stream (a barge-in): stop the utterance
                with contextlib.suppress(Exception):
                    await session.interrupt(uid)
            await utils.aio.gracefully_cancel(sender, receiver)
