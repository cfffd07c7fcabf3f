"""ElevenLabs-compatible WebSockets: `/v1/text-to-speech/{voice_id}/stream-input` (one stream per
socket) and `/multi-stream-input` (contexts), as the ElevenLabs SDKs, Pipecat's
ElevenLabsTTSService and livekit-plugins-elevenlabs speak them (docs/compat.md).

One native session per socket (voice from the path, through the alias table; `language_code` and
`output_format` from the query); each context is one native utterance. Client -> native:
- a context's first message with blank text (`{"text": " ", voice_settings, ...}`) opens it;
  text -> `speak.append` (`flush: true` -> with flush); `{"text": ""}` ends a stream-input stream
  (`speak.end`) and is a keep-alive on multi-stream-input;
- `close_context`: when everything sent was flushed, the context finishes (`speak.end`: its audio
  completes, then `isFinal`); with text sent since the last flush, or when it is closed a second
  time (Pipecat closes a finished turn's context, then again on barge-in), it stops now
  (`speak.cancel`): the barge-in ElevenLabs documents; `close_socket`: every context stops, the
  socket closes.
Native -> client: audio packets -> `{"audio", "alignment", "normalizedAlignment", "contextId"}`
(PCM and G.711 as packetised; MP3 and Opus encoded here as they come), with character times from
the session's words (gateway.compat.alignment; `sync_alignment=true` puts them on the context's
timeline, otherwise each message's times count from where the previous message's ended);
`utterance.done` / `utterance.interrupted` -> `{"isFinal": true, "contextId"}`; errors ->
`{"error": code, "message", "contextId"}`.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.compat.alignment import CharTimeline
from gateway.compat.bridge import Compat, DialectSocket, NativeLink, NativeMessage, read_frame
from gateway.compat.encoding import StreamEncoder
from gateway.errors import CLOSE_POLICY
from gateway.languages import normalise_language
from gateway.messages import SAMPLE_RATES, PacketHeader

DEFAULT_FORMAT: Final = "mp3_44100_128"
_FORMAT: Final = re.compile(r"^(pcm|ulaw|alaw|mp3|opus)_(\d+)(?:_(\d+))?$")


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """An `output_format` as the native session's output, and the encoder after it (if any)."""

    encoding: str  # native encoding
    sample_rate: int
    container: str | None = None  # "mp3" / "opus": encoded here
    bit_rate: int | None = None


def parse_output_format(name: str) -> OutputFormat:
    match = _FORMAT.match(name)
    if match is None:
        raise ValueError(f"unknown output_format {name[:40]!r}")
    kind, rate, kbps = match.group(1), int(match.group(2)), match.group(3)
    if kind in ("ulaw", "alaw"):
        if rate != 8000 or kbps:
            raise ValueError(f"{kind} is 8000 Hz only: {kind}_8000")
        return OutputFormat("mulaw" if kind == "ulaw" else "alaw", 8000)
    if rate not in SAMPLE_RATES:
        raise ValueError(f"sample rates offered: {', '.join(map(str, SAMPLE_RATES))}")
    if kind == "pcm":
        if kbps:
            raise ValueError(f"{name[:40]!r}: pcm takes no bit rate")
        return OutputFormat("pcm_s16le", rate)
    if kind == "opus" and rate != 48000:
        raise ValueError("opus is 48000 Hz: opus_48000_<kbps>")
    if not kbps or not 8 <= int(kbps) <= 320:
        raise ValueError(f"{kind} needs a bit rate in kbps: {kind}_{rate}_<kbps>")
    return OutputFormat("pcm_s16le", rate, kind, int(kbps) * 1000)


def _flag(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes")


@dataclass(eq=False)
class _Context:
    context_id: str
    utterance_id: str
    timeline: CharTimeline
    encoder: StreamEncoder | None
    opened: bool = False  # text went to the native session
    unflushed: bool = False  # text sent since the last flush
    closing: bool = False  # close_context came: finishing
    final_sent: bool = False
    stream: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ElevenLabsSocket(DialectSocket):
    def __init__(self, websocket: WebSocket, compat: Compat, multi: bool) -> None:
        super().__init__(websocket, compat)
        self.multi = multi
        query = websocket.query_params
        self.format_name = query.get("output_format") or DEFAULT_FORMAT
        self.sync_alignment = _flag(query.get("sync_alignment"))
        self.language = normalise_language(query.get("language_code")) if query.get("language_code") else None
        self.voice = compat.voice(str(websocket.path_params.get("voice_id") or "") or None)
        self.format: OutputFormat | None = None
        self.link: NativeLink | None = None
        self.contexts: dict[str, _Context] = {}  # by context id (live ones)
        self.by_utterance: dict[str, _Context] = {}
        self.by_stream: dict[int, _Context] = {}
        self._count = 0

    async def start(self) -> bool:
        try:
            self.format = parse_output_format(self.format_name)
        except ValueError as exc:
            await self.fail("invalid_output_format", str(exc))
            return False
        return True

    async def fail(self, code: str, message: str, context_id: str | None = None) -> None:
        error: dict[str, Any] = {"error": code, "message": message}
        if context_id is not None:
            error["contextId"] = context_id
        await self.send_json(error)
        self.close(CLOSE_POLICY, message)

    # -- client -> native --------------------------------------------------------------------
    async def on_text(self, text: str) -> None:
        if self.format is None:
            return  # refused at the start: the socket is closing
        message = await read_frame(text)
        if message is None:
            await self.send_json({"error": "invalid_message", "message": "a message is a JSON object"})
            return
        if self.auth_pending:
            credential = (
                message.get("xi-api-key") or message.get("xi_api_key") or message.get("authorization")
            )
            if isinstance(credential, str) and credential.lower().startswith("bearer "):
                credential = credential[7:]
            problem = await self.authenticate(credential if isinstance(credential, str) else None)
            if problem is not None:
                await self.fail("unauthorized", problem)
                return
        if message.get("close_socket"):
            await self._close_all()
            return
        context_id = str(message.get("context_id") or "") if self.multi else ""
        if self.multi and not context_id:
            context_id = "default"
        if message.get("close_context"):
            await self._close_context(context_id)
            return
        raw = message.get("text")
        if raw is not None and not isinstance(raw, str):
            await self._error("invalid_message", "`text` must be a string", context_id)
            return
        flush = message.get("flush") is True
        ctx = self.contexts.get(context_id)
        if ctx is None:
            ctx = self._new_context(context_id)
            if raw is not None and not raw.strip() and not flush:
                return  # the context's opening message (its text is a lone space)
        if raw == "" and not flush:
            if self.multi:
                self._keep_alive(ctx)
            elif ctx.opened:
                self._end(ctx)  # stream-input: the end of the text
            else:
                await self._final(ctx)  # stream-input ended with nothing said: it ends at once
            return
        self._append(ctx, raw or "", flush)

    def _new_context(self, context_id: str) -> _Context:
        assert self.format is not None
        self._count += 1
        encoder = (
            StreamEncoder(self.format.container, self.format.sample_rate, self.format.bit_rate)  # type: ignore[arg-type]
            if self.format.container
            else None
        )
        ctx = _Context(context_id, f"c{self._count}", CharTimeline(relative=not self.sync_alignment), encoder)
        self.contexts[context_id] = ctx
        self.by_utterance[ctx.utterance_id] = ctx
        return ctx

    def _native(self) -> NativeLink:
        if self.link is None or self.link.closed:
            assert self.format is not None
            self.link = self.open_link(
                "main",
                {
                    "type": "session.start",
                    "voice": self.voice,
                    "language": self.language,
                    "output": {"encoding": self.format.encoding, "sample_rate": self.format.sample_rate},
                    "timestamps": "word",
                },
            )
        return self.link

    def _append(self, ctx: _Context, text: str, flush: bool) -> None:
        if ctx.final_sent:
            return
        if text:
            ctx.timeline.add_text(text)
            ctx.opened = True
            self._native().send(
                {"type": "speak.append", "utterance_id": ctx.utterance_id, "text": text, "flush": flush}
            )
        elif flush and ctx.opened:
            self._native().send({"type": "speak.flush", "utterance_id": ctx.utterance_id})
        if flush:
            ctx.unflushed = False
        elif text:
            ctx.unflushed = True

    def _keep_alive(self, ctx: _Context) -> None:
        """multi-stream-input's `{"text": ""}`: ElevenLabs resets the context's inactivity timer, so
        an empty append resets the native utterance's text timeout (a context still taking text)."""
        if ctx.opened and not ctx.closing and not ctx.final_sent:
            self._native().send({"type": "speak.append", "utterance_id": ctx.utterance_id, "text": ""})

    def _end(self, ctx: _Context) -> None:
        if ctx.opened:
            self._native().send({"type": "speak.end", "utterance_id": ctx.utterance_id})

    async def _close_context(self, context_id: str) -> None:
        ctx = self.contexts.get(context_id)
        if ctx is None or ctx.final_sent:
            return
        if not ctx.opened:
            await self._final(ctx)
        elif ctx.unflushed or ctx.closing:
            self._native().send({"type": "speak.cancel", "utterance_id": ctx.utterance_id})
        else:
            ctx.closing = True
            self._end(ctx)

    async def _close_all(self) -> None:
        for ctx in list(self.contexts.values()):
            if ctx.opened and not ctx.final_sent:
                self._native().send({"type": "speak.cancel", "utterance_id": ctx.utterance_id})
        self.close(1000, "close_socket")

    # -- native -> client --------------------------------------------------------------------
    async def on_link_message(self, link: NativeLink, message: NativeMessage) -> None:
        kind = message.get("type")
        ctx = self.by_utterance.get(str(message.get("utterance_id")))
        if ctx is None and "utterance_id" in message:
            return  # about a context that has ended already: nothing new
        if kind == "utterance.started" and ctx is not None:
            ctx.stream = int(message["stream"])
            self.by_stream[ctx.stream] = ctx
        elif kind == "words" and ctx is not None:
            ctx.timeline.add_words(message.get("words") or [])
        elif kind == "utterance.done" and ctx is not None:
            ctx.timeline.finish(int(message.get("duration_ms") or 0))
            await self._audio(ctx, b"")
            await self._final(ctx)
        elif kind == "utterance.interrupted" and ctx is not None:
            await self._final(ctx)
        elif kind == "error":
            await self._error(
                str(message.get("code")), str(message.get("message")), ctx.context_id if ctx else None
            )
            if ctx is not None and not ctx.final_sent:
                # some errors leave the native utterance going (text_too_long refuses one append):
                # the context ends here, so its engine stream ends too
                self._native().send({"type": "speak.cancel", "utterance_id": ctx.utterance_id})
                await self._final(ctx)

    async def on_link_audio(self, link: NativeLink, header: PacketHeader, payload: bytes) -> None:
        ctx = self.by_stream.get(header.stream)
        if ctx is None or ctx.final_sent:
            return
        data = payload
        if ctx.encoder is not None:
            data = ctx.encoder.encode(np.frombuffer(payload, dtype="<i2"))
            if header.last:
                data += ctx.encoder.finish()
        if data:
            await self._audio(ctx, data)

    async def _audio(self, ctx: _Context, data: bytes) -> None:
        alignment = ctx.timeline.take()
        if not data and alignment is None:
            return
        message: dict[str, Any] = {
            "audio": base64.b64encode(data).decode("ascii"),
            "isFinal": None,
            "alignment": alignment,
            "normalizedAlignment": alignment,
        }
        if self.multi:
            message["contextId"] = ctx.context_id
        await self.send_json(message)

    async def _final(self, ctx: _Context) -> None:
        if ctx.final_sent:
            return
        ctx.final_sent = True
        if ctx.encoder is not None:
            ctx.encoder.close()
        if self.contexts.get(ctx.context_id) is ctx:
            del self.contexts[ctx.context_id]
        self.by_utterance.pop(ctx.utterance_id, None)
        if ctx.stream is not None:
            self.by_stream.pop(ctx.stream, None)
        if self.multi:
            await self.send_json({"isFinal": True, "contextId": ctx.context_id})
        else:
            await self.send_json({"isFinal": True})
            self.close(1000, "stream finished")

    async def _error(self, code: str, message: str, context_id: str | None) -> None:
        error: dict[str, Any] = {"error": code, "message": message}
        if context_id is not None and self.multi:
            error["contextId"] = context_id
        await self.send_json(error)

    async def on_link_closed(self, link: NativeLink) -> None:
        if link.close_code not in (None, 1000):  # a policy close (quota, slow client): say why
            await self.send_json({"error": "closed", "message": link.close_reason or "session closed"})
            self.close(link.close_code or 1011, link.close_reason)

    async def finished(self) -> None:
        for ctx in list(self.contexts.values()):
            if ctx.encoder is not None:
                ctx.encoder.close()


class ElevenLabsEndpoints:
    def __init__(self, compat: Compat) -> None:
        self.compat = compat

    def routes(self) -> list[BaseRoute]:
        return [
            WebSocketRoute("/v1/text-to-speech/{voice_id}/stream-input", self.stream_input),
            WebSocketRoute("/v1/text-to-speech/{voice_id}/multi-stream-input", self.multi_stream_input),
        ]

    async def stream_input(self, websocket: WebSocket) -> None:
        await self._serve(websocket, multi=False)

    async def multi_stream_input(self, websocket: WebSocket) -> None:
        await self._serve(websocket, multi=True)

    async def _serve(self, websocket: WebSocket, multi: bool) -> None:
        await websocket.accept()
        socket = ElevenLabsSocket(websocket, self.compat, multi)
        await socket.start()  # a bad output_format: the error, then the close
        await socket.run()
