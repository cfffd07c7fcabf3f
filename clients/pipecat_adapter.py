# mypy: disable-error-code="no-untyped-call"
"""A Pipecat TTS service that speaks through Cadence's `WS /v1/stream` (extra `cadence[pipecat]`).

    tts = CadenceTTSService(url="ws://127.0.0.1:8000/v1/stream", voice="Vivian", language="English")
    pipeline = Pipeline([..., llm, tts, transport.output(), assistant_aggregator])

Each Pipecat turn (its context id) is one Cadence utterance: every sentence Pipecat hands over is a
`speak.append` (flushed), the turn's end is `speak.end`. Audio packets become `TTSAudioRawFrame`s
of that context; Cadence's `words` become Pipecat word timestamps, so Pipecat emits each word's
`TTSTextFrame` when playback reaches it, and an interrupted turn keeps only the words heard. On
a Pipecat interruption the utterance is cancelled (`speak.cancel`): Cadence's fence guarantees
that no packet of it follows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import WebsocketTTSService
from websockets.protocol import State

from gateway.messages import HEADER_BYTES, unpack_packet


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
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("settings", TTSSettings(model=None, voice=voice, language=language))
        super().__init__(push_text_frames=False, push_start_frame=True, sample_rate=sample_rate, **kwargs)
        self._url = url
        self._token = token
        self._session_options: dict[str, Any] = {"timestamps": "word", "pacing": pacing}
        for name, value in (("voice", voice), ("language", language), ("instructions", instructions)):
            if value is not None:
                self._session_options[name] = value
        self._requested_rate = sample_rate
        self._streams: dict[int, str] = {}  # Cadence stream handle -> Pipecat context id
        self._open: set[str] = set()  # context ids with an utterance still taking text
        self._receive_task: Any = None
        self.interruptions: list[dict[str, Any]] = []  # Cadence's reports of the cancelled turns

    def can_generate_metrics(self) -> bool:
        return True

    # -- connection ---------------------------------------------------------------------------
    async def setup(self, setup: FrameProcessorSetup) -> None:  # type: ignore[override]
        await super().setup(setup)
        await self._connect()

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        if self._websocket is not None and self._receive_task is None:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._receive_task is not None:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
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
        if context_id and self._websocket is not None:
            self._open.discard(context_id)
            await self._send({"type": "speak.cancel", "utterance_id": context_id})
        await super().on_audio_context_interrupted(context_id)

    # -- audio and words out ------------------------------------------------------------------
    async def _receive_messages(self) -> None:
        assert self._websocket is not None
        async for frame in self._websocket:
            if isinstance(frame, bytes):
                await self._on_packet(frame)
            else:
                await self._on_message(json.loads(frame))

    async def _on_packet(self, frame: bytes) -> None:
        if len(frame) < HEADER_BYTES:
            return
        header, payload = unpack_packet(frame)
        context_id = self._streams.get(header.stream)
        if context_id is None or not self.audio_context_available(context_id) or not payload:
            return
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
            await self.add_word_timestamps(
                [(w["text"], w["start_ms"] / 1000.0) for w in message.get("words", [])], context_id
            )
        elif kind == "utterance.done" and context_id:
            self._forget(context_id)
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
        elif kind == "utterance.interrupted" and context_id:
            self._forget(context_id)
            self.interruptions.append(message)
        elif kind == "error":
            await self.push_error(error_msg=f"Cadence {message.get('code')}: {message.get('message')}")
            if context_id and self.audio_context_available(context_id):
                self._forget(context_id)
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)

    def _forget(self, context_id: str) -> None:
        self._open.discard(context_id)
        for stream, owner in list(self._streams.items()):
            if owner == context_id:
                del self._streams[stream]
