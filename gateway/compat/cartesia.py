"""Cartesia-compatible WebSocket `/tts/websocket`, as the Cartesia SDKs, Pipecat's
CartesiaTTSService and livekit-plugins-cartesia speak it (docs/compat.md).

Each context is one native utterance, on a native session chosen by the context's settings
(voice, language, raw output format; contexts that share them share a session). Client -> native:
a generation request's `transcript` -> `speak.append` (`flush: true`, or `max_buffer_delay_ms: 0`,
-> with flush); `continue: false` (the default) -> `speak.end` after it; `cancel` ->
`speak.cancel`, answered with nothing (a late `done` for a cancelled context would end another
context's read in Cartesia's own SDK). Native -> client: packets -> `chunk` (base64 raw audio,
with the current `flush_id`), words -> `timestamps` (seconds on the context's timeline, when
`add_timestamps`), `flush_done` once the audio of a flushed transcript has been sent,
`utterance.done` -> `done`, errors -> `error` with `title`, `message`, `error_code` and `error`.
Credentials: `X-API-Key`, `Authorization: Bearer`, `?api_key=`, `?access_token=` (gateway.auth);
`Cartesia-Version` (header or `?cartesia_version=`) is accepted whatever its value.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, field
from typing import Any, Final

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.compat.bridge import Compat, DialectSocket, NativeLink, NativeMessage, read_frame
from gateway.languages import normalise_language
from gateway.messages import SAMPLE_RATES, PacketHeader

ENCODINGS: Final = {
    "pcm_s16le": "pcm_s16le",
    "pcm_f32le": "pcm_f32le",
    "pcm_mulaw": "mulaw",
    "pcm_alaw": "alaw",
}
BYTES_PER_SAMPLE: Final = {"pcm_s16le": 2, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}


class RequestError(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


@dataclass(frozen=True, slots=True)
class Settings:
    """What a context's native session is started with."""

    voice: str | None
    language: str | None
    encoding: str  # native encoding
    sample_rate: int


def settings_of(request: dict[str, Any], compat: Compat) -> Settings:
    voice = request.get("voice")
    voice_id: str | None = None
    if isinstance(voice, dict):
        mode = voice.get("mode", "id")
        if mode != "id":
            raise RequestError(
                "unsupported_voice_mode",
                f'voice mode {str(mode)[:20]!r} is not offered; use {{"mode": "id"}}',
            )
        if voice.get("id") is not None and not isinstance(voice.get("id"), str):
            raise RequestError("invalid_voice", "`voice.id` must be a string")
        voice_id = voice.get("id")
    elif isinstance(voice, str):
        voice_id = voice
    elif voice is not None:
        raise RequestError("invalid_voice", '`voice` must be an object {"mode": "id", "id": ...}')
    output = request.get("output_format") or {
        "container": "raw",
        "encoding": "pcm_s16le",
        "sample_rate": 24000,
    }
    if not isinstance(output, dict):
        raise RequestError("invalid_output_format", "`output_format` must be an object")
    if output.get("container", "raw") != "raw":
        raise RequestError(
            "unsupported_output_format",
            'only the raw container is offered on the WebSocket (`"container": "raw"`)',
        )
    encoding = ENCODINGS.get(str(output.get("encoding", "pcm_s16le")))
    if encoding is None:
        raise RequestError("unsupported_output_format", f"encoding must be one of {', '.join(ENCODINGS)}")
    rate = output.get("sample_rate", 24000)
    if isinstance(rate, bool) or rate not in SAMPLE_RATES:
        raise RequestError(
            "unsupported_output_format", f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))}"
        )
    if encoding in ("mulaw", "alaw") and rate != 8000:
        raise RequestError(
            "unsupported_output_format", f"{output.get('encoding')} is offered at 8000 Hz only"
        )
    language = request.get("language")
    if language is not None and not isinstance(language, str):
        raise RequestError("invalid_language", "`language` must be a string")
    return Settings(
        compat.voice(voice_id), normalise_language(language) if language else None, encoding, int(rate)
    )


@dataclass(eq=False)
class _Context:
    context_id: str
    utterance_id: str
    link: NativeLink
    timestamps: bool
    bytes_per_sample: int
    sample_rate: int
    stream: int | None = None
    text: str = ""
    ended: bool = False  # continue: false came
    finished: bool = False  # done / error sent, or cancelled
    flush_id: int = 1
    flushes: list[int] = field(default_factory=list)  # text lengths flushed, awaiting flush_done
    words: list[tuple[int, int]] = field(default_factory=list)  # (char_end, end_ms)
    sent_ms: int = 0


class CartesiaSocket(DialectSocket):
    def __init__(self, websocket: WebSocket, compat: Compat) -> None:
        super().__init__(websocket, compat)
        self.contexts: dict[str, _Context] = {}
        self.by_utterance: dict[str, _Context] = {}
        self.by_stream: dict[tuple[int, int], _Context] = {}  # (id(link), stream)
        self._count = 0

    async def error(self, code: str, message: str, context_id: str | None = None, status: int = 400) -> None:
        await self.send_json(
            {
                "type": "error",
                "context_id": context_id,
                "done": True,
                "status_code": status,
                "title": code.replace("_", " ").capitalize(),
                "message": message,
                "error_code": code,
                "error": message,
                "request_id": uuid.uuid4().hex,
            }
        )

    # -- client -> native --------------------------------------------------------------------
    async def on_text(self, text: str) -> None:
        request = await read_frame(text)
        if request is None:
            await self.error("invalid_request", "a message is a JSON object")
            return
        context_id = request.get("context_id")
        if not isinstance(context_id, str) or not context_id:
            await self.error("invalid_request", "`context_id` is required (a string)")
            return
        if request.get("cancel") is True:
            ctx = self.contexts.get(context_id)
            if ctx is not None and not ctx.finished:
                ctx.finished = True
                ctx.link.send({"type": "speak.cancel", "utterance_id": ctx.utterance_id})
            return
        try:
            await self._generate(context_id, request)
        except RequestError as exc:
            await self.error(exc.code, exc.message, context_id, exc.status)

    async def _generate(self, context_id: str, request: dict[str, Any]) -> None:
        transcript = request.get("transcript", "")
        if not isinstance(transcript, str):
            raise RequestError("invalid_transcript", "`transcript` must be a string")
        more = request.get("continue", False)
        if not isinstance(more, bool):
            raise RequestError("invalid_request", "`continue` must be true or false")
        ctx = self.contexts.get(context_id)
        if ctx is None or ctx.finished:
            ctx = self._open(
                context_id, settings_of(request, self.compat), request.get("add_timestamps") is True
            )
        elif ctx.ended:
            raise RequestError("context_closed", f"context {context_id[:60]!r} takes no more input")
        flush = request.get("flush") is True or request.get("max_buffer_delay_ms") == 0
        if transcript:
            ctx.text += transcript
            ctx.link.send(
                {"type": "speak.append", "utterance_id": ctx.utterance_id, "text": transcript, "flush": flush}
            )
        elif flush and ctx.text:
            ctx.link.send({"type": "speak.flush", "utterance_id": ctx.utterance_id})
        if request.get("flush") is True:
            ctx.flushes.append(_last_letter_end(ctx.text))
            await self._flush_done(ctx)
        if not more:
            ctx.ended = True
            if ctx.text:
                ctx.link.send({"type": "speak.end", "utterance_id": ctx.utterance_id})
            else:
                await self._done(ctx)

    def _open(self, context_id: str, settings: Settings, timestamps: bool) -> _Context:
        link = self.links.get(settings)
        if link is None or link.closed:
            link = self.open_link(
                settings,
                {
                    "type": "session.start",
                    "voice": settings.voice,
                    "language": settings.language,
                    "output": {"encoding": settings.encoding, "sample_rate": settings.sample_rate},
                    "timestamps": "word",
                },
            )
        self._count += 1
        ctx = _Context(
            context_id,
            f"k{self._count}",
            link,
            timestamps,
            BYTES_PER_SAMPLE[settings.encoding],
            settings.sample_rate,
        )
        self.contexts[context_id] = ctx
        self.by_utterance[ctx.utterance_id] = ctx
        return ctx

    # -- native -> client --------------------------------------------------------------------
    async def on_link_message(self, link: NativeLink, message: NativeMessage) -> None:
        kind = message.get("type")
        ctx = self.by_utterance.get(str(message.get("utterance_id")))
        if ctx is None:  # an error about an utterance that has ended already says nothing new
            if kind == "error" and "utterance_id" not in message:
                await self.error(str(message.get("code")), str(message.get("message")))
            return
        if kind in ("utterance.done", "utterance.interrupted", "error"):
            self.by_utterance.pop(ctx.utterance_id, None)
        if kind == "utterance.started":
            ctx.stream = int(message["stream"])
            self.by_stream[(id(link), ctx.stream)] = ctx
        elif ctx.finished:
            if kind in ("utterance.done", "utterance.interrupted", "error"):
                self._forget(ctx)  # a cancel may cross the utterance's end: either way it is over
            return  # cancelled: nothing more for it
        elif kind == "words":
            words = message.get("words") or []
            ctx.words += [(int(w["char_end"]), int(w["end_ms"])) for w in words]
            if ctx.timestamps and words:
                await self.send_json(
                    {
                        "type": "timestamps",
                        "context_id": ctx.context_id,
                        "done": False,
                        "status_code": 206,
                        "flush_id": ctx.flush_id,
                        "word_timestamps": {
                            "words": [w["text"] for w in words],
                            "start": [w["start_ms"] / 1000 for w in words],
                            "end": [w["end_ms"] / 1000 for w in words],
                        },
                    }
                )
            await self._flush_done(ctx)
        elif kind == "utterance.done":
            await self._flush_done(ctx, everything=True)
            await self._done(ctx)
        elif kind == "error":
            ctx.finished = True
            self._forget(ctx)
            # some errors leave the native utterance going (text_too_long refuses one append):
            # the context ends here, so its engine stream ends too
            link.send({"type": "speak.cancel", "utterance_id": ctx.utterance_id})
            await self.error(str(message.get("code")), str(message.get("message")), ctx.context_id)

    async def on_link_audio(self, link: NativeLink, header: PacketHeader, payload: bytes) -> None:
        ctx = self.by_stream.get((id(link), header.stream))
        if ctx is None or ctx.finished:
            return
        samples = header.sample_offset + len(payload) // ctx.bytes_per_sample
        ctx.sent_ms = samples * 1000 // ctx.sample_rate
        if payload:
            await self.send_json(
                {
                    "type": "chunk",
                    "context_id": ctx.context_id,
                    "data": base64.b64encode(payload).decode("ascii"),
                    "done": False,
                    "status_code": 206,
                    "step_time": 0.0,
                    "flush_id": ctx.flush_id,
                }
            )
        await self._flush_done(ctx)

    async def _flush_done(self, ctx: _Context, everything: bool = False) -> None:
        """Acknowledge each flush whose text has been heard: its last word's audio has been sent."""
        while ctx.flushes:
            target = ctx.flushes[0]
            if not everything and target > 0:
                heard = next((end for char_end, end in ctx.words if char_end >= target), None)
                if heard is None or heard > ctx.sent_ms:
                    return
            ctx.flushes.pop(0)
            await self.send_json(
                {
                    "type": "flush_done",
                    "context_id": ctx.context_id,
                    "done": False,
                    "flush_done": True,
                    "flush_id": ctx.flush_id,
                    "status_code": 206,
                }
            )
            ctx.flush_id += 1

    async def _done(self, ctx: _Context) -> None:
        if ctx.finished:
            return
        ctx.finished = True
        await self.send_json({"type": "done", "context_id": ctx.context_id, "done": True, "status_code": 206})
        self._forget(ctx)

    def _forget(self, ctx: _Context) -> None:
        if self.contexts.get(ctx.context_id) is ctx:
            del self.contexts[ctx.context_id]
        if ctx.stream is not None:
            self.by_stream.pop((id(ctx.link), ctx.stream), None)

    async def on_link_closed(self, link: NativeLink) -> None:
        if link.close_code not in (None, 1000):
            for ctx in list(self.contexts.values()):
                if ctx.link is link and not ctx.finished:
                    ctx.finished = True
                    await self.error(
                        "session_closed", link.close_reason or "session closed", ctx.context_id, 500
                    )


def _last_letter_end(text: str) -> int:
    """Where the last letter or digit of `text` ends (0: none): a flush is heard when it is."""
    return next((i + 1 for i in range(len(text) - 1, -1, -1) if text[i].isalnum()), 0)


class CartesiaEndpoints:
    def __init__(self, compat: Compat) -> None:
        self.compat = compat

    def routes(self) -> list[BaseRoute]:
        return [WebSocketRoute("/tts/websocket", self.websocket)]

    async def websocket(self, websocket: WebSocket) -> None:
        await websocket.accept()
        await CartesiaSocket(websocket, self.compat).run()
