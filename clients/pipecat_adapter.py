# mypy: disable-error-code="no-untyped-call"
"""A Pipecat TTS service that speaks through Cadence's `WS /v1/stream` (extra `cadence[pipecat]`).

    tts = CadenceTTSService(url="ws://127.0.0.1:8000/v1/stream", voice="Vivian", language="English")
    pipeline = Pipeline([..., llm, tts, transport.output(), assistant_aggregator])

Each Pipecat turn (its context id) is one Cadence utterance: every sentence Pipecat hands over is a
`speak.append` (flushed), the turn's end is `speak.end`. Audio packets become `TTSAudioRawFrame`s
of that context; Cadence's `words` become Pipecat word timestamps (each handed over with the
audio it starts in), so Pipecat emits each word's `TTSTextFrame` when playback reaches it, and an
interrupted turn keeps only the words heard. On a Pipecat interruption the utterance is cancelled
(`speak.cancel`): Cadence's fence guarantees that no packet of it follows.

False interruptions (`false_interruption_timeout_s`): when the VAD hears the user start speaking
during a turn, the turn is paused on Cadence (`speak.pause`: nothing more is sent, what is made is
kept); if Pipecat then interrupts (its turn strategy found words), the turn is cancelled as usual;
if the user stops and no interruption comes within the timeout, it goes on (`speak.unpause`) from
the first sample after the fence, and the later words' times move by the pause. Let Pipecat
interrupt on words, not on the VAD alone (a minimum-words turn start strategy), or every sound
interrupts at once.

A lost connection (a network fault, or the server closing the socket) takes its Cadence session,
and the text of its unfinished turns, with it: each such turn ends there with a non-fatal
`ErrorFrame` that names it (category connectivity) and its `TTSStoppedFrame` (the audio received
still plays). The connection is then made again, by Pipecat's reconnect or at the next turn's text,
and later text is spoken on it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    VADUserStartedSpeakingFrame,
    VADUserStoppedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import WebsocketTTSService
from pipecat.utils.errors import ErrorCategory
from websockets.protocol import State

from gateway.messages import HEADER_BYTES, MESSAGE_REFUSED_CODES, unpack_packet


class CadenceTTSService(WebsocketTTSService):
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
        false_interruption_timeout_s: float | None = None,
        pause_timeout_ms: int | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("settings", TTSSettings(model=None, voice=voice, language=language))
        if false_interruption_timeout_s is not None:  # a paused turn is quiet: Pipecat must not end it
            kwargs.setdefault("stop_frame_timeout_s", (pause_timeout_ms or 5000) / 1000 + 1.0)
        super().__init__(push_text_frames=False, push_start_frame=True, sample_rate=sample_rate, **kwargs)
        self._url = url
        self._token = token
        self._session_options: dict[str, Any] = {"timestamps": "word", "pacing": pacing}
        if pause_timeout_ms is not None:
            self._session_options["pause_timeout_ms"] = pause_timeout_ms
        self._false_interruption_s = false_interruption_timeout_s
        for name, value in (("voice", voice), ("language", language), ("instructions", instructions)):
            if value is not None:
                self._session_options[name] = value
        self._requested_rate = sample_rate
        self._streams: dict[int, str] = {}  # Cadence stream handle -> Pipecat context id
        self._open: set[str] = set()  # context ids with an utterance still taking text
        self._unfinished: dict[str, None] = {}  # turns sent to Cadence whose audio has not all come, in order
        self._receive_task: Any = None
        self._connecting = asyncio.Lock()  # a turn's text and the receive loop's reconnect may both connect
        self.interruptions: list[dict[str, Any]] = []  # Cadence's reports of the cancelled turns
        self.pauses: list[dict[str, Any]] = []  # Cadence's reports of the paused turns
        self._words: dict[str, deque[tuple[str, int]]] = {}  # per turn: (word, start_ms) not handed over
        self._received_ms: dict[str, float] = {}  # per turn: audio received, ms
        self._shift_s: dict[str, float] = {}  # per turn: how long its pauses lasted
        self._paused: dict[str, float] = {}  # turns paused on Cadence -> when (monotonic)
        self._resume_task: Any = None

    def can_generate_metrics(self) -> bool:
        return True

    # -- connection ---------------------------------------------------------------------------
    async def setup(self, setup: FrameProcessorSetup) -> None:  # type: ignore[override]
        await super().setup(setup)
        await self._connect()

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        # a receive loop that ended (its connection closed and was not made again) is started anew
        receiving = self._receive_task is not None and not self._receive_task.done()
        if self._websocket is not None and not receiving:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _reconnect_websocket(self, attempt_number: int) -> bool:
        # a turn's text may have made the connection again while this loop waited to: the turn's
        # audio comes on that connection, so the loop reads it rather than closing it and the turn
        if self._websocket is not None and self._websocket.state is State.OPEN:
            return True
        return await super()._reconnect_websocket(attempt_number)

    async def _connect_websocket(self) -> None:
        async with self._connecting:  # the one being made is used, not a second one beside it
            await self._open_websocket()

    async def _open_websocket(self) -> None:
        if self._websocket is not None and self._websocket.state is State.OPEN:
            return
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            self._websocket = await self._websocket_connect(
                self._url, additional_headers=headers, max_size=None, compression=None
            )
            output = {
                "encoding": "pcm_s16le",
                "sample_rate": self.sample_rate or self._requested_rate,
                "packet_ms": 20,
            }
            await self._websocket.send(
                json.dumps({"type": "session.start", "output": output, **self._session_options})
            )
            self._streams.clear()
            self._open.clear()
            await self._call_event_handler("on_connected")
        except Exception as exc:
            self._websocket = None
            await self.push_error(error_msg=f"Cadence connection failed: {exc}", exception=exc)
            await self._call_event_handler("on_connection_error", f"{exc}")

    async def _disconnect_websocket(self) -> None:
        try:
            await self.stop_all_metrics()
            if self._websocket is not None:
                await self._websocket.close()
        finally:
            self._websocket = None
            await self._call_event_handler("on_disconnected")

    async def _send(self, message: dict[str, Any]) -> None:
        if self._websocket is None:
            raise ConnectionError("not connected to Cadence")
        await self._websocket.send(json.dumps(message, ensure_ascii=False))

    # -- text in ------------------------------------------------------------------------------
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        try:
            if self._websocket is None or self._websocket.state is State.CLOSED:
                await self._connect()
            await self._send(
                {"type": "speak.append", "utterance_id": context_id, "text": text, "flush": True}
            )
            self._open.add(context_id)
            self._unfinished[context_id] = None
            await self.start_tts_usage_metrics(text)
            yield None
        except Exception as exc:
            yield ErrorFrame(error=f"Cadence: {exc}")
            yield TTSStoppedFrame(context_id=context_id)

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn's text is complete: end the utterance (its audio then finishes)."""
        target = context_id or self.get_active_audio_context_id()
        if target and target in self._open and self._websocket is not None:
            self._open.discard(target)
            await self._send({"type": "speak.end", "utterance_id": target})

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Pipecat interrupted the turn: cancel it on Cadence (the fence stops its packets)."""
        await self.stop_all_metrics()
        self._paused.pop(context_id, None)
        self._unfinished.pop(context_id, None)  # ended by the user, not lost with a connection
        if context_id and self._websocket is not None:
            self._open.discard(context_id)
            await self._send({"type": "speak.cancel", "utterance_id": context_id})
        await super().on_audio_context_interrupted(context_id)

    # -- false interruptions ------------------------------------------------------------------
    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if self._false_interruption_s is None:
            return
        if isinstance(frame, VADUserStartedSpeakingFrame):
            await self._cancel_resume()
            await self._pause_turns()
        elif isinstance(frame, VADUserStoppedSpeakingFrame) and self._paused:
            await self._cancel_resume()
            self._resume_task = self.create_task(self._resume_after(self._false_interruption_s))

    async def _pause_turns(self) -> None:
        """The user may be speaking: stop the turns whose audio is still coming."""
        if self._websocket is None:
            return
        for context_id in dict.fromkeys(self._streams.values()):
            if context_id not in self._paused and self.audio_context_available(context_id):
                self._paused[context_id] = time.monotonic()
                await self._send({"type": "speak.pause", "utterance_id": context_id})

    async def _resume_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._resume_task = None
        paused, self._paused = self._paused, {}
        for context_id, since in paused.items():  # no interruption came: it was not speech
            if self._websocket is not None and self.audio_context_available(context_id):
                self._shift_s[context_id] = self._shift_s.get(context_id, 0.0) + time.monotonic() - since
                await self._send({"type": "speak.unpause", "utterance_id": context_id})

    async def _cancel_resume(self) -> None:
        if self._resume_task is not None:
            task, self._resume_task = self._resume_task, None
            await self.cancel_task(task)

    # -- audio and words out ------------------------------------------------------------------
    async def _receive_messages(self) -> None:
        assert self._websocket is not None
        try:
            async for frame in self._websocket:
                if isinstance(frame, bytes):
                    await self._on_packet(frame)
                else:
                    await self._on_message(json.loads(frame))
        finally:
            if not self._disconnecting:  # not our own close: the server or the network ended it
                await self._end_lost_turns()

    async def _end_lost_turns(self) -> None:
        """The connection is gone, and with it Cadence's session: the rest of each unfinished
        turn will never come, so each ends now with an error frame that names it."""
        lost, self._unfinished = self._unfinished, {}
        for context_id in lost:
            self._forget(context_id)
            await self.push_error(
                error_msg=f"Cadence connection lost: turn {context_id} ended before all its audio came",
                category=ErrorCategory.CONNECTIVITY,
            )
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)

    async def _on_packet(self, frame: bytes) -> None:
        if len(frame) < HEADER_BYTES:
            return
        header, payload = unpack_packet(frame)
        context_id = self._streams.get(header.stream)
        if context_id is None or not self.audio_context_available(context_id) or not payload:
            return
        self._received_ms[context_id] = (header.sample_offset + len(payload) // 2) * 1000 / self.sample_rate
        await self._hand_words(context_id)
        await self.stop_ttfb_metrics()
        await self.append_to_audio_context(
            context_id,
            TTSAudioRawFrame(
                audio=payload, sample_rate=self.sample_rate, num_channels=1, context_id=context_id
            ),
        )

    async def _on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        context_id = message.get("utterance_id")
        if kind == "utterance.started":
            self._streams[int(message["stream"])] = str(context_id)
        elif kind == "words" and context_id and self.audio_context_available(context_id):
            pending = self._words.setdefault(context_id, deque())
            pending.extend((w["text"], w["start_ms"]) for w in message.get("words", []))
            await self._hand_words(context_id)
        elif kind == "utterance.done" and context_id:
            if self.audio_context_available(context_id):
                await self._hand_words(context_id, every=True)
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
            self._forget(context_id)
        elif kind == "utterance.paused" and context_id:
            self.pauses.append(message)
        elif kind == "utterance.interrupted" and context_id:
            self._forget(context_id)
            self.interruptions.append(message)
            if self.audio_context_available(context_id):  # Cadence ended it (a pause that timed out)
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
        elif kind == "error":
            await self.push_error(error_msg=f"Cadence {message.get('code')}: {message.get('message')}")
            # a refused append (or unpause) of a turn Cadence has started leaves that turn playing
            started = context_id in self._streams.values()
            if started and message.get("code") in MESSAGE_REFUSED_CODES:
                return
            self._unfinished.pop(str(context_id), None)  # it ended here, with its error
            if context_id and self.audio_context_available(context_id):
                self._forget(context_id)
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)

    async def _hand_words(self, context_id: str, every: bool = False) -> None:
        """Words go to Pipecat with the audio they start in (a paused turn's later words wait for
        theirs), timed on the turn's audio moved by its pauses."""
        pending = self._words.get(context_id)
        if not pending:
            return
        received, shift = self._received_ms.get(context_id, 0.0), self._shift_s.get(context_id, 0.0)
        ready: list[tuple[str, float]] = []
        while pending and (every or pending[0][1] < received):
            text, start_ms = pending.popleft()
            ready.append((text, start_ms / 1000.0 + shift))
        if ready:
            await self.add_word_timestamps(ready, context_id)

    def _forget(self, context_id: str) -> None:
        self._open.discard(context_id)
        self._unfinished.pop(context_id, None)
        self._paused.pop(context_id, None)
        for state in (self._words, self._received_ms, self._shift_s):
            state.pop(context_id, None)
        for stream, owner in list(self._streams.items()):
            if owner == context_id:
                del self._streams[stream]
