"""vLLM-Omni-compatible streaming WebSocket for Qwen3-TTS, `/v1/audio/speech/stream`: the protocol
that engine.vllm_omni speaks as a client and livekit-plugins-baseten's Qwen3-TTS client speaks to
Baseten (docs/compat.md).

`session.config` (voice / speaker, language, instructions, response_format, stream_audio, speed,
word_timestamps, timestamp_type, sample_rate; may be replaced between utterances) starts a native
session (a new one when the voice, language, instructions or rate change). Each run of
`input.text` up to an `input.done` is one utterance, one "sentence" in vLLM-Omni's terms; its
text goes to the engine as it comes, not at `input.done`, and the next utterance may be made while
this one is still being sent. Utterances go out in order: `audio.start`, the audio (binary s16le
frames; base64 `audio.chunk` frames with `word_timestamps`, the last one carrying the words;
with `stream_audio: false` one binary frame of the whole file in `response_format`), `audio.done`
(with `timestamp_info` for `timestamp_type: "word"`), then `session.done`. An `input.done` with no
text answers `session.done` with zero sentences at once (a keep-alive). `session.close` closes
once the utterances ended before it are sent (the one being sent, still taking text, ends failed);
closing the socket is the barge-in: every utterance in flight is cancelled. `voice.list` answers
with the engine's voices. Errors: `{"type": "error", "message"}`. A native error that refuses one
message and leaves its utterance going (`text_too_long` on a later `input.text`; gateway.messages'
MESSAGE_REFUSED_CODES) is one such error, with its `code`, in that utterance's turn, and the
utterance goes on; one that refuses the utterance's opening, or an engine failure, fails it.
`audio.start`'s `sentence_text` is the utterance's text as far as it has come, less any refused
`input.text`; an utterance that failed before any of its audio names none.

vLLM-Omni serves a connection's utterances in turn however many the client sends ahead, so the
native session's limit on open utterances stays inside: at most that many are open on it, the rest
wait here with their text and go to it in order as earlier ones finish. Past
`MAX_QUEUED_UTTERANCES` on one connection an utterance is refused with
`{"type": "error", "code": "too_many_utterances", "message"}` and not answered further.
"""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from gateway.compat.bridge import Compat, DialectSocket, NativeLink, NativeMessage, read_frame
from gateway.compat.encoding import CONTAINERS, Container, EncodingError, StreamEncoder, check_format
from gateway.languages import normalise_language
from gateway.messages import MESSAGE_REFUSED_CODES, SAMPLE_RATES, PacketHeader

CONFIG_TIMEOUT_S: Final = 10.0
# utterances one connection may have queued (open, waiting or being sent); each holds its text and
# the audio made before its turn, so the bound keeps one client from holding the server's memory
MAX_QUEUED_UTTERANCES: Final = 256
KNOWN_TASKS: Final = ("CustomVoice", "VoiceDesign", "Base")
# the native refusals of one input.text while its utterance goes on (the rest of it is spoken)
TEXT_REFUSALS: Final = frozenset({"text_too_long", "rate_limited", "utterance_closed"})


class ConfigError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Config:
    voice: str | None
    language: str | None
    instructions: str | None
    sample_rate: int
    stream_audio: bool
    response_format: Container
    word_timestamps: bool  # audio.chunk frames, words in the last
    timestamp_info: bool  # words in audio.done (timestamp_type "word")

    @property
    def session_key(self) -> tuple[str | None, str | None, str | None, int]:
        return (self.voice, self.language, self.instructions, self.sample_rate)


def parse_config(message: dict[str, Any], compat: Compat) -> Config:
    voice = message.get("voice", message.get("speaker"))
    if isinstance(voice, dict):
        voice = voice.get("id")
    for name, value in (
        ("voice", voice),
        ("language", message.get("language")),
        ("instructions", message.get("instructions")),
    ):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"`{name}` must be a string")
    task = message.get("task_type")
    if task is not None and task not in KNOWN_TASKS:
        raise ConfigError(f"task_type must be one of {', '.join(KNOWN_TASKS)}")
    stream_audio = message.get("stream_audio", False) is True
    fmt = message.get("response_format") or ("pcm" if stream_audio else "wav")
    if fmt not in CONTAINERS:
        raise ConfigError(f"response_format must be one of {', '.join(CONTAINERS)}")
    if stream_audio and fmt != "pcm":
        raise ConfigError("WebSocket streaming audio (stream_audio=true) requires response_format='pcm'.")
    speed = message.get("speed", 1.0)
    if speed not in (None, 1, 1.0):
        raise ConfigError("speed must be 1.0 on this WebSocket (use POST /v1/audio/speech for other speeds)")
    rate = message.get("sample_rate") or 24000
    if isinstance(rate, bool) or rate not in SAMPLE_RATES:
        raise ConfigError(f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))}")
    if not stream_audio:
        try:  # the file is encoded at `sample_rate`: refused here, not when its audio comes
            check_format(fmt, int(rate))
        except EncodingError as exc:
            raise ConfigError(str(exc)) from None
    granularity = message.get("split_granularity", "none")
    if granularity not in ("none", "sentence", "clause"):
        raise ConfigError("split_granularity must be none, sentence or clause")
    language = message.get("language")
    return Config(
        voice=compat.voice(voice),
        language=normalise_language(language) if language else None,
        instructions=message.get("instructions"),
        sample_rate=int(rate),
        stream_audio=stream_audio,
        response_format=next(c for c in CONTAINERS if c == fmt),
        word_timestamps=message.get("word_timestamps") is True,
        timestamp_info=message.get("timestamp_type") == "word",
    )


@dataclass(eq=False)
class _Utterance:
    index: int
    config: Config
    link: NativeLink | None  # None: an empty input.done (a keep-alive)
    utterance_id: str = ""
    # its input.text pieces in order (the opening one with the blanks before it), and which of them
    # the native session refused: `sentence_text` is the others
    pieces: list[str] = field(default_factory=list)
    refused: set[int] = field(default_factory=set)
    # its opening speak.append went to the native session; the messages after it wait in `pending`
    # until `admitted` (utterance.started), so that an error before then can only be the refusal of
    # the opening, and nothing of a refused utterance opens a native one the queue does not count
    opened: bool = False
    admitted: bool = False
    pending: list[NativeMessage] = field(default_factory=list)
    refusals: list[dict[str, Any]] = field(default_factory=list)  # errors to send in its turn
    stream: int | None = None
    ended: bool = False  # input.done came
    done: bool = False  # utterance.done (or its error) came
    failed: str | None = None
    started: bool = False  # audio.start sent
    total_bytes: int = 0
    held: deque[bytes] = field(default_factory=deque)  # audio made before its turn
    words: list[dict[str, Any]] = field(default_factory=list)
    encoder: StreamEncoder | None = None
    file: bytearray = field(default_factory=bytearray)  # stream_audio false: the file so far


class VllmOmniSocket(DialectSocket):
    def __init__(self, websocket: WebSocket, compat: Compat) -> None:
        super().__init__(websocket, compat)
        self.config: Config | None = None
        self.queue: deque[_Utterance] = deque()  # in order; the first is the one being sent
        self.by_utterance: dict[str, _Utterance] = {}
        self.by_stream: dict[tuple[int, int], _Utterance] = {}
        self.current: _Utterance | None = None  # taking input.text
        self._index = 0
        self._leading = ""  # blanks before an utterance's first words
        self._refusing = False  # the utterance being sent was refused: its text is dropped
        self._configured = asyncio.Event()
        self._drain_lock = asyncio.Lock()
        self._close_requested = False  # session.close came: close once the queue is sent

    async def error(self, message: str) -> None:
        await self.send_json({"type": "error", "message": message})

    async def run(self) -> None:
        watchdog = asyncio.get_running_loop().create_task(self._config_watchdog())
        try:
            await super().run()
        finally:
            watchdog.cancel()

    async def _config_watchdog(self) -> None:
        try:
            await asyncio.wait_for(self._configured.wait(), CONFIG_TIMEOUT_S)
        except TimeoutError:
            await self.error("Timeout waiting for session.config")
            self.close(1000, "no session.config")

    # -- client -> native --------------------------------------------------------------------
    async def on_text(self, text: str) -> None:
        if self._close_requested:
            return  # vLLM-Omni reads nothing after session.close
        message = await read_frame(text)
        if message is None:
            await self.error("Invalid JSON message")
            return
        kind = message.get("type")
        if kind == "session.config":
            await self._configure(message)
        elif kind == "voice.list":
            await self.send_json(
                {"type": "voice.list", "voices": list(self.compat.engine.voices), "uploaded_voices": []}
            )
        elif kind == "voice.add":
            await self.error("voice.add is not offered here: register voices with POST /v1/voices")
        elif self.config is None:
            await self.error(f"Expected session.config, got: {str(kind)[:40]}")
        elif kind == "input.text":
            piece = message.get("text", "")
            if not isinstance(piece, str):
                await self.error("`text` must be a string")
                return
            await self._add_text(piece)
        elif kind == "input.done":
            await self._input_done()
        elif kind == "session.close":
            await self._session_close()
        else:
            await self.error(f"Unknown message type: {str(kind)[:40]}")

    async def _configure(self, message: dict[str, Any]) -> None:
        if self.current is not None and self.current.pieces:
            await self.error(
                "session.config cannot be applied while an utterance is in progress; send input.done first"
            )
            return
        try:
            self.config = parse_config(message, self.compat)
        except ConfigError as exc:
            await self.error(f"Invalid session config: {exc}")
            return
        self._configured.set()

    def _link(self, config: Config) -> NativeLink:
        link = self.links.get(config.session_key)
        if link is None or link.closed:
            link = self.open_link(
                config.session_key,
                {
                    "type": "session.start",
                    "voice": config.voice,
                    "language": config.language,
                    "instructions": config.instructions,
                    "output": {"encoding": "pcm_s16le", "sample_rate": config.sample_rate},
                    "timestamps": "word",
                },
            )
        return link

    async def _add_text(self, piece: str) -> None:
        assert self.config is not None
        utt = self.current
        if utt is None:
            if self._refusing:
                return
            if not piece.strip():
                self._leading += piece  # no utterance for blanks alone
                return
            piece, self._leading = self._leading + piece, ""
            if await self._queue_full():
                self._refusing = True  # its later text, up to its input.done, goes with it
                return
            utt = self.current = self._new(self._link(self.config))
        elif utt.done:  # its native utterance has ended: nothing more reaches it
            if utt.failed is None and piece.strip():
                await self._refuse_closed(utt)
            return
        utt.pieces.append(piece)
        self._speak(utt, {"type": "speak.append", "utterance_id": utt.utterance_id, "text": piece})
        if not utt.opened:
            self._open_waiting()

    async def _refuse_closed(self, utt: _Utterance) -> None:
        """Text for an utterance whose native one has ended (its text stayed open past the
        session's text timeout): the session would refuse it with utterance_closed, and the
        client hears so in the utterance's turn."""
        utt.refusals.append(
            {
                "type": "error",
                "code": "utterance_closed",
                "message": f"utterance {utt.index} has ended (its text was left open too long); "
                "this text is not spoken",
            }
        )
        await self._drain()

    async def _queue_full(self) -> bool:
        """Whether a new utterance is past the bound; if so it is refused with a typed error."""
        if len(self.queue) < MAX_QUEUED_UTTERANCES:
            return False
        await self.send_json(
            {
                "type": "error",
                "code": "too_many_utterances",
                "message": f"at most {MAX_QUEUED_UTTERANCES} utterances may be queued on one "
                "connection; this one is dropped (send it again once earlier ones are done)",
            }
        )
        return True

    def _speak(self, utt: _Utterance, message: NativeMessage) -> None:
        """A native message about `utt`: sent if its session has admitted it, else kept for then."""
        if utt.link is None or utt.failed is not None:
            return
        if utt.admitted:
            utt.link.send(message)
        else:
            utt.pending.append(message)

    def _admit(self, utt: _Utterance) -> None:
        """utterance.started: the messages kept behind the opening go now, in order."""
        utt.admitted = True
        assert utt.link is not None
        for message in utt.pending:
            utt.link.send(message)
        utt.pending.clear()

    def _fail(self, utt: _Utterance, reason: str) -> None:
        """The native utterance has ended without its audio (or never opened)."""
        utt.failed = reason
        utt.done = True
        utt.pending.clear()

    def _open_waiting(self) -> None:
        """Open waiting utterances in order while their session has room (its
        max_open_utterances): a native session refuses more than that with too_many_utterances."""
        open_on: dict[int, int] = {}
        for utt in self.queue:
            if utt.link is None or utt.done:
                continue
            key = id(utt.link)
            if not utt.opened:
                if open_on.get(key, 0) >= self.compat.max_open_utterances:
                    continue
                utt.opened = True
                utt.link.send(utt.pending.pop(0))  # its first speak.append opens it
            open_on[key] = open_on.get(key, 0) + 1

    def _new(self, link: NativeLink | None) -> _Utterance:
        assert self.config is not None
        utt = _Utterance(self._index, self.config, link)
        self._index += 1
        if link is not None:
            utt.utterance_id = f"u{utt.index}"
            self.by_utterance[utt.utterance_id] = utt
            if not self.config.stream_audio:
                utt.encoder = StreamEncoder(self.config.response_format, self.config.sample_rate)
        self.queue.append(utt)
        return utt

    async def _input_done(self) -> None:
        utt, self.current, self._leading = self.current, None, ""
        if self._refusing:
            self._refusing = False
            return
        if utt is None:  # nothing since the last one: answered at once, in its turn (a keep-alive)
            if await self._queue_full():
                return
            utt = self._new(None)
            utt.done = True
        elif not utt.done:  # a native utterance that has ended (its text timeout) takes no speak.end
            self._speak(utt, {"type": "speak.end", "utterance_id": utt.utterance_id})
        utt.ended = True
        await self._drain()

    async def _session_close(self) -> None:
        """vLLM-Omni serves a connection's messages in turn, so every utterance ended by an
        input.done before session.close is sent whole before the close; text not yet ended by an
        input.done is dropped. A cut utterance whose audio.start has gone out (it is the one being
        sent) still ends on the wire: as a failed one, unless its native utterance had
        already ended, so that every audio.start has its audio.done and session.done."""
        self._close_requested = True
        utt, self.current, self._leading = self.current, None, ""
        if utt is not None:
            if utt.opened and not utt.done and utt.link is not None:
                # admitted or not: the cancel follows its opening; one that has ended takes none
                utt.link.send({"type": "speak.cancel", "utterance_id": utt.utterance_id})
            if utt.started:
                if not utt.done:
                    self._fail(utt, "session.close came before its input.done; the rest is dropped")
                utt.ended = True  # the drain below ends it in its turn, before the close
            else:
                if self.queue and self.queue[-1] is utt:
                    self.queue.pop()
                self._forget(utt)
                if utt.encoder is not None:
                    utt.encoder.close()
            self._open_waiting()
        await self._drain()

    # -- native -> client, in order ----------------------------------------------------------
    async def on_link_message(self, link: NativeLink, message: NativeMessage) -> None:
        utt = self.by_utterance.get(str(message.get("utterance_id")))
        if utt is None:  # an error about an utterance that has ended already says nothing new
            if message.get("type") == "error" and "utterance_id" not in message:
                await self.error(str(message.get("message")))
            return
        kind = message.get("type")
        if kind == "utterance.started":
            utt.stream = int(message["stream"])
            self.by_stream[(id(link), utt.stream)] = utt
            self._admit(utt)
        elif kind == "words":
            utt.words += message.get("words") or []
        elif kind in ("utterance.done", "utterance.interrupted"):
            utt.done = True
            self._open_waiting()
        elif kind == "error":
            self._native_error(utt, message)
        await self._drain()

    def _native_error(self, utt: _Utterance, message: NativeMessage) -> None:
        """An error about `utt` ends it when it refuses its opening (nothing after the opening is
        sent before utterance.started) or when the engine failed it; the codes that refuse one
        later message leave it going, and the client hears them in its turn, as vLLM-Omni answers
        a message it refuses: `{"type": "error", "message"}` (here with the native `code`)."""
        if utt.failed is not None:
            return  # its failure is what the client hears
        code, text = str(message.get("code")), str(message.get("message"))
        if utt.done or (utt.admitted and code in MESSAGE_REFUSED_CODES):
            utt.refusals.append({"type": "error", "code": code, "message": text})
            if code in TEXT_REFUSALS:
                _refuse_piece(utt, code, self.compat.max_text_chars)
            return
        self._fail(utt, str(message.get("message")))
        self._open_waiting()

    async def on_link_closed(self, link: NativeLink) -> None:
        """A native session that ends under this connection (a frame over its size limit, its
        idle timeout) ends what it held: those utterances fail; the ones waiting for it wait for a
        new session instead."""
        if self._closing:
            return  # the client has gone: nothing more is opened
        reason = f"the session closed ({link.close_code} {link.close_reason})".replace(" )", ")")
        for utt in self.queue:
            if utt.link is not link or utt.done:
                continue
            if utt.opened:
                self._fail(utt, reason)
            else:
                utt.link = self._link(utt.config)
        self._open_waiting()
        await self._drain()

    async def on_link_audio(self, link: NativeLink, header: PacketHeader, payload: bytes) -> None:
        utt = self.by_stream.get((id(link), header.stream))
        if utt is None or not payload:
            return
        utt.held.append(payload)
        await self._drain()

    def _forget(self, utt: _Utterance) -> None:
        self.by_utterance.pop(utt.utterance_id, None)
        if utt.stream is not None and utt.link is not None:
            self.by_stream.pop((id(utt.link), utt.stream), None)

    async def _drain(self) -> None:
        """Send what the first utterance in line has; when it is done, go on to the next (one
        drain at a time: the reader and the native sessions all call it)."""
        async with self._drain_lock:
            await self._drain_locked()

    async def _drain_locked(self) -> None:
        while self.queue:
            utt = self.queue[0]
            while utt.refusals:
                await self.send_json(utt.refusals.pop(0))
            if utt.link is not None and (utt.held or (utt.done and not utt.started)):
                await self._start(utt)
            while utt.held:
                await self._send_audio(utt, utt.held.popleft())
            if not (utt.done and utt.ended):
                return
            self.queue.popleft()
            self._forget(utt)
            try:
                await self._finish(utt)
            finally:  # a failed utterance's file is never finished, and a send may raise
                if utt.encoder is not None:
                    utt.encoder.close()  # after finish(), nothing is left to free
        if self._close_requested:
            self.close(1000, "session.close")

    async def _start(self, utt: _Utterance) -> None:
        if utt.started:
            return
        utt.started = True
        await self.send_json(
            {
                "type": "audio.start",
                "utterance_index": utt.index,
                "sentence_index": 0,
                "sentence_text": _sentence_text(utt),
                "format": utt.config.response_format,
                "sample_rate": utt.config.sample_rate,
                "channels": 1,
            }
        )

    async def _send_audio(self, utt: _Utterance, pcm: bytes) -> None:
        if utt.encoder is not None:
            utt.file += utt.encoder.encode(np.frombuffer(pcm, dtype="<i2"))
            return
        utt.total_bytes += len(pcm)
        if utt.config.word_timestamps:
            await self.send_json(self._chunk(utt, base64.b64encode(pcm).decode("ascii"), None))
        else:
            await self.send_bytes(pcm)

    def _chunk(
        self, utt: _Utterance, audio_b64: str, timestamps: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        return {
            "type": "audio.chunk",
            "utterance_index": utt.index,
            "sentence_index": 0,
            "audio_b64": audio_b64,
            "timestamps": timestamps,
        }

    async def _finish(self, utt: _Utterance) -> None:
        if utt.link is not None:
            await self._start(utt)
            stamps = [
                {"word": w["text"], "start_ms": w["start_ms"], "end_ms": w["end_ms"]} for w in utt.words
            ]
            done: dict[str, Any] = {
                "type": "audio.done",
                "utterance_index": utt.index,
                "sentence_index": 0,
                "total_bytes": utt.total_bytes,
                "error": utt.failed is not None,
            }
            if utt.failed is not None:
                await self.error(f"Generation failed for utterance {utt.index}, sentence 0: {utt.failed}")
            elif utt.encoder is not None:
                utt.file += utt.encoder.finish()
                done["total_bytes"] = len(utt.file)
                if utt.file:
                    await self.send_bytes(bytes(utt.file))
            elif utt.config.word_timestamps:
                await self.send_json(self._chunk(utt, "", stamps))
            if utt.config.timestamp_info and utt.failed is None:
                done["timestamp_info"] = {
                    "word_alignment": {
                        "words": [s["word"] for s in stamps],
                        "word_start_times_seconds": [s["start_ms"] / 1000 for s in stamps],
                        "word_end_times_seconds": [s["end_ms"] / 1000 for s in stamps],
                    }
                }
            await self.send_json(done)
        sentences = 1 if utt.link is not None else 0
        await self.send_json(
            {"type": "session.done", "utterance_index": utt.index, "total_sentences": sentences}
        )

    async def finished(self) -> None:
        for utt in self.queue:
            if utt.encoder is not None:
                utt.encoder.close()


def _refuse_piece(utt: _Utterance, code: str, max_text_chars: int) -> None:
    """Mark the input.text piece of `utt` that a native refusal is about. The native session takes
    an utterance's pieces in order and refuses each on its own, but its refusal does not say which
    one, and more of them may have gone on before it comes back. Past max_text_chars it is the first
    piece that does not fit beside the ones taken before it, as the session applies that limit;
    otherwise (the key's characters per minute, the native text timeout) it is the
    latest piece not yet marked: the native text timeout refuses every piece after its own, and a
    refused piece is the latest unless the client's next one went on before the refusal came back."""
    left = [i for i in range(len(utt.pieces)) if i not in utt.refused]
    if not left:
        return
    if code == "text_too_long":
        taken = 0
        for i in left:
            if taken + len(utt.pieces[i]) > max_text_chars:
                utt.refused.add(i)
                return
            taken += len(utt.pieces[i])
    utt.refused.add(left[-1])


def _sentence_text(utt: _Utterance) -> str:
    """The text synthesised for `utt`: its pieces less the refused ones, or none when it failed
    before any of its audio came (its opening refused, or its native session gone)."""
    if utt.failed is not None and not utt.held:
        return ""
    return "".join(p for i, p in enumerate(utt.pieces) if i not in utt.refused).strip()


class VllmOmniEndpoints:
    def __init__(self, compat: Compat) -> None:
        self.compat = compat

    def routes(self) -> list[BaseRoute]:
        return [WebSocketRoute("/v1/audio/speech/stream", self.websocket)]

    async def websocket(self, websocket: WebSocket) -> None:
        await websocket.accept()
        await VllmOmniSocket(websocket, self.compat).run()
