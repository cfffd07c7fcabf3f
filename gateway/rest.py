"""POST /v1/audio/speech as OpenAI's speech endpoint (and its SDK) use it, plus `language`,
`timestamps` and one-off voice clones (`ref_audio`, `ref_text`).

`model`: OpenAI's names (tts-1, tts-1-hd, gpt-4o-mini-tts, ...) or ours (`cadence`, the engine's
name or model); all speak with the one engine, and `instructions` are ignored with tts-1 and
tts-1-hd, as OpenAI documents. `voice`: a name or `{"id": ...}`, OpenAI's names mapped to engine
voices by the alias table (gateway.compat.voices). `response_format` (default mp3): mp3, opus
(Ogg), aac (ADTS), wav and pcm (s16le mono at `rest_sample_rate`) are streamed as they are made;
flac comes whole (gateway.compat.encoding says why). `stream_format: "sse"` streams
`speech.audio.delta` events (base64 pieces of the file in `response_format`) and ends with
`speech.audio.done`; with `timestamps: true` it adds `speech.audio.words` events.
Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 400 for bad input, 429 with
Retry-After when the engine is overloaded, 503 `shutting_down` with Retry-After while the gateway
drains, 500 for engine failures.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import soxr
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.api import (
    AudioChunk,
    Engine,
    EngineError,
    EngineInfo,
    SynthesisRequest,
    SynthesisStream,
    float_samples,
)
from gateway.auth import Principal, principal_of
from gateway.bodies import parse_json_body
from gateway.compat.encoding import CONTAINERS, MEDIA_TYPES, OPUS_RATES, Container, StreamEncoder
from gateway.compat.voices import VoiceAliases
from gateway.config import GatewayConfig
from gateway.errors import error_code, public_message, retry_after_s
from gateway.languages import normalise_language
from gateway.messages import ErrorCode
from gateway.metrics import GatewayMetrics
from gateway.packets import StreamResampler, to_int16
from gateway.quotas import QuotaError, Quotas
from gateway.segmenter import UtteranceText
from gateway.voices import ClipError, decode_clip, read_limited

log = logging.getLogger("cadence.rest")

OPENAI_MODELS = (
    "tts-1",
    "tts-1-hd",
    "tts-1-1106",
    "tts-1-hd-1106",
    "gpt-4o-mini-tts",
    "gpt-4o-mini-tts-2025-03-20",
    "gpt-4o-mini-tts-2025-12-15",
)
NO_INSTRUCTIONS = ("tts-1", "tts-1-hd", "tts-1-1106", "tts-1-hd-1106")  # as OpenAI documents


class BadRequest(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    input: str
    voice: str | None
    instructions: str | None
    language: str
    response_format: Container
    speed: float
    sse: bool
    timestamps: bool
    # a one-off voice clone: the reference clip (mono samples, rate) and its transcript
    ref_audio: tuple[npt.NDArray[np.float32], int] | None = None
    ref_text: str | None = None
    max_wait_ms: int | None = None  # the longest it may wait in the engine's queue for admission


def error_response(
    status: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status, headers=headers
    )


def _optional_text(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest("invalid_message", f"`{name}` must be a string")
    return value


def served_models(engine: EngineInfo) -> tuple[str, ...]:
    return (*OPENAI_MODELS, "cadence", engine.name, engine.model)


def parse_speech_request(
    body: object,
    config: GatewayConfig,
    engine: EngineInfo | None = None,
    aliases: VoiceAliases | None = None,
) -> SpeechRequest:
    if not isinstance(body, dict):
        raise BadRequest("invalid_message", "the body must be a JSON object")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise BadRequest("invalid_message", "`input` must be a non-empty string")
    if len(text) > config.max_text_chars:
        raise BadRequest("text_too_long", f"`input` holds at most {config.max_text_chars} characters")
    model = _optional_text(body, "model")
    if model is not None and engine is not None and model not in served_models(engine):
        raise BadRequest(
            "invalid_request",
            f"model {model[:60]!r} is not served here; use one of {', '.join(served_models(engine))}",
        )
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise BadRequest("invalid_message", "`stream_format` must be audio or sse")
    sse = stream_format == "sse"
    fmt = body.get("response_format") or "mp3"
    if fmt not in CONTAINERS:
        raise BadRequest("unsupported_output", f"`response_format` must be one of {', '.join(CONTAINERS)}")
    speed = body.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.25 <= speed <= 4.0:
        raise BadRequest("invalid_message", "`speed` must be a number from 0.25 to 4.0")
    timestamps = body.get("timestamps", False)
    if not isinstance(timestamps, bool):
        raise BadRequest("invalid_message", "`timestamps` must be true or false")
    response_format: Container = next(c for c in CONTAINERS if c == fmt)
    max_wait_ms = body.get("max_wait_ms")
    if max_wait_ms is not None and (
        isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, int) or not 0 <= max_wait_ms <= 2**31
    ):
        raise BadRequest("invalid_message", "`max_wait_ms` must be a whole number of milliseconds")
    ref_audio = _reference_clip(body.get("ref_audio"), None if engine is None else engine.sample_rate)
    voice = _voice(body.get("voice"))
    if engine is not None:
        voice = (aliases or VoiceAliases()).resolve(voice, engine)
    instructions = _optional_text(body, "instructions")
    if model in NO_INSTRUCTIONS:
        instructions = None
    return SpeechRequest(
        input=text,
        voice=voice,
        instructions=instructions,
        language=normalise_language(_optional_text(body, "language")),
        response_format=response_format,
        speed=float(speed),
        sse=sse,
        timestamps=timestamps,
        ref_audio=ref_audio,
        ref_text=_optional_text(body, "ref_text"),
        max_wait_ms=max_wait_ms,
    )


def _voice(value: object) -> str | None:
    """`voice`: a name, or OpenAI's custom-voice object `{"id": ...}`."""
    if isinstance(value, dict):
        value = value.get("id")
        if not isinstance(value, str) or not value:
            raise BadRequest("invalid_message", "`voice.id` must be a non-empty string")
    if value is not None and not isinstance(value, str):
        raise BadRequest("invalid_message", "`voice` must be a string or an object with an `id`")
    return value


def _reference_clip(value: object, rate: int | None = None) -> tuple[npt.NDArray[np.float32], int] | None:
    """`ref_audio`: an audio file (WAV, FLAC, OGG, ...) as base64 or a `data:` URL, resampled to
    `rate` (the engine's) when given."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(
            "invalid_audio", "`ref_audio` must be a base64 string or a data: URL of an audio file"
        )
    payload = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("invalid_audio", "`ref_audio` is not valid base64") from None
    try:
        audio, clip_rate = decode_clip(data)
    except ClipError as exc:
        raise BadRequest("invalid_audio", str(exc)) from None
    if rate is not None and clip_rate != rate:
        # the clone engines take their clip at their own rate and resample it in open(), which
        # runs on the event loop: here, off the loop, a high-rate clip costs no session its audio
        # (float32 soxr HQ, as the engines resample it)
        audio = np.ascontiguousarray(soxr.resample(audio, clip_rate, rate, quality="HQ"), dtype=np.float32)
        clip_rate = rate
    return audio, clip_rate


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _Synthesis:
    """One request's audio at the REST output rate, as int16 PCM pieces."""

    def __init__(
        self,
        stream: SynthesisStream,
        engine_rate: int,
        out_rate: int,
        metrics: GatewayMetrics,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_done = on_done
        self.stream = stream
        self.engine_rate = engine_rate
        self.out_rate = out_rate
        self.metrics = metrics
        self.samples_out = 0
        self.started = time.monotonic()
        self._resampler = StreamResampler(engine_rate, out_rate)
        self._first = True

    async def pieces(self) -> AsyncIterator[tuple[bytes, AudioChunk]]:
        try:
            async for chunk in self.stream:
                audio = self._resampler.process(float_samples(chunk.samples), last=chunk.final)
                self.samples_out += len(audio)
                if len(audio) and self._first:
                    self._first = False
                    self.metrics.ttfa.labels("rest").observe(time.monotonic() - self.started)
                yield to_int16(audio).astype("<i2").tobytes(), chunk
                if chunk.final:
                    break
        finally:
            self.stream.cancel()
            self.on_done()
        if self.samples_out:
            rtf = (time.monotonic() - self.started) / (self.samples_out / self.out_rate)
            self.metrics.rtf.labels("rest").observe(rtf)


class _QuotaHold:
    """One REST utterance counted against its key until `release()` (idempotent)."""

    def __init__(self, quotas: Quotas | None, key_id: str) -> None:
        self.quotas, self.key_id, self.held = quotas, key_id, False

    def take(self, chars: int) -> None:
        if self.quotas is None:
            return
        # text no budget can hold is refused before a busy count, whose 429 would invite a retry
        self.quotas.check_fits(self.key_id, chars)
        self.quotas.begin_utterance(self.key_id)
        self.held = True
        try:
            self.quotas.take_chars(self.key_id, chars, time.monotonic())
        except QuotaError:
            self.release()
            raise

    def release(self) -> None:
        if self.held and self.quotas is not None:
            self.held = False
            self.quotas.end_utterance(self.key_id)


def make_speech_endpoint(
    engine: Engine,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    quotas_for: Callable[[Principal], Quotas | None] = lambda principal: None,
    aliases: VoiceAliases | None = None,
    draining: Callable[[], bool] = lambda: False,
    voice_usable: Callable[[str, str], bool] = lambda key_id, voice: True,
) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint; while `draining()` it refuses new requests (the ones in flight go on).
    `voice_usable(key_id, voice)`: whether the key may speak in a voice (VoiceRegistry.usable_by)."""

    def fail(
        status: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        metrics.errors.labels(code).inc()
        return error_response(status, code, message, headers)

    async def speech(request: Request) -> Response:
        if draining():
            return refuse_while_draining()
        # text, plus room for a one-off reference clip (base64: 4/3 of the file)
        limit = config.max_message_bytes + config.max_text_chars * 4 + config.max_voice_upload_bytes * 4 // 3
        raw = await read_limited(request, limit)
        if raw is None:
            return fail(413, "text_too_long", "request body too large")
        try:
            body = await parse_json_body(raw)
        except ValueError:
            return fail(400, "invalid_message", "the body is not valid JSON")
        principal = principal_of(request)
        one_off = isinstance(body, dict) and body.get("ref_audio") is not None
        if one_off and not principal.may_change_voices():  # refused before its clip is decoded
            return fail(403, "unauthorized", "a token limited to some voices may not clone one")
        try:
            if one_off:
                # a reference clip is decoded like a registered one: off the event loop that
                # carries every session's audio, and within the registry's decode time
                req = await asyncio.wait_for(
                    asyncio.to_thread(parse_speech_request, body, config, engine.info, aliases),
                    config.voice_decode_timeout_s,
                )
            else:  # no clip: nothing in it costs the loop more than its JSON did
                req = parse_speech_request(body, config, engine.info, aliases)
        except BadRequest as exc:
            return fail(400, exc.code, exc.message)
        except TimeoutError:
            return fail(
                400, "invalid_audio", "`ref_audio` took too long to decode: send a shorter or simpler file"
            )
        refusal = voice_refusal(principal, req.voice)
        if refusal is not None:
            return refusal
        hold = _QuotaHold(quotas_for(principal), principal.key_id)
        try:
            hold.take(len(req.input))
        except QuotaError as exc:
            if exc.retry_after_header is None:  # no wait lets it through (text over the whole budget)
                return fail(400, exc.code, exc.message)
            return fail(429, exc.code, exc.message, {"Retry-After": exc.retry_after_header})
        try:
            response = await _speak(request, req, hold)
        except BaseException:
            hold.release()
            raise
        if not isinstance(response, StreamingResponse):  # done (or refused): a stream releases at its end
            hold.release()
        return response

    def voice_refusal(principal: Principal, voice: str | None) -> JSONResponse | None:
        """A scoped token's voices only, and registered voices of the caller's key only: another
        key's voice answers as a voice that does not exist."""
        if not principal.may_use_voice(voice):
            return fail(403, "unauthorized", f"this token may not use voice {voice!r}")
        if voice is not None and not voice_usable(principal.key_id, voice):
            return fail(400, "unknown_voice", f"unknown voice {voice!r}")
        return None

    def refuse_while_draining() -> JSONResponse:
        # the drain ends within its timeout; `Connection: close` sends the retry over a new
        # connection, which another replica or a restarted process takes
        return fail(
            503,
            "shutting_down",
            "the server is shutting down: retry on a new connection",
            {"Retry-After": str(max(1, math.ceil(config.drain_timeout_s))), "Connection": "close"},
        )

    async def _speak(request: Request, req: SpeechRequest, hold: _QuotaHold) -> Response:
        request_id = f"rest-{uuid.uuid4().hex[:12]}"
        try:
            stream = engine.open(
                SynthesisRequest(
                    request_id=request_id,
                    voice=req.voice,
                    language=req.language,
                    instructions=req.instructions,
                    speed=req.speed,
                    ref_audio=req.ref_audio,
                    ref_text=req.ref_text,
                    max_wait_s=None if req.max_wait_ms is None else req.max_wait_ms / 1000,
                    # words only when asked for: an engine with a forced aligner then admits the
                    # request without counting it towards the aligner's share
                    word_alignment=None if req.timestamps else "off",
                )
            )
        except EngineError as exc:
            wait = retry_after_s(exc)
            if wait is not None:
                return fail(
                    429, "overloaded", public_message(exc), {"Retry-After": str(max(1, math.ceil(wait)))}
                )
            status = 500 if error_code(exc) == "internal" else 400
            return fail(status, error_code(exc), public_message(exc))
        metrics.utterances.labels("rest").inc()
        segmenter = UtteranceText(req.language, config.segment_max_chars, config.segment_clause_min_chars)
        try:
            for segment in segmenter.feed(req.input) + segmenter.flush():
                stream.push(segment)
            stream.close_text()
        except EngineError as exc:
            stream.cancel()
            return fail(400, error_code(exc), public_message(exc))
        rate = config.rest_sample_rate
        if req.response_format == "opus" and rate not in OPUS_RATES:
            rate = 48_000  # Opus has no 22.05 / 44.1 kHz mode; its decoders play 48 kHz anyway
        synthesis = _Synthesis(stream, engine.info.sample_rate, rate, metrics, hold.release)
        headers = {"X-Sample-Rate": str(rate), "X-Request-Id": request_id}
        release = BackgroundTask(hold.release)  # also when the client left before the first byte
        encoder = StreamEncoder(req.response_format, rate)
        if req.sse:
            return StreamingResponse(
                _sse_events(synthesis, req, metrics, encoder),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
                background=release,
            )
        media_type = MEDIA_TYPES[req.response_format]
        if req.response_format == "flac":  # whole: its header holds the length
            # nothing is sent before the end, so no send notices a client that leaves: a watcher
            # does, and cancels the stream rather than let it synthesise for no one
            watcher = asyncio.ensure_future(_cancel_when_gone(request, stream))
            try:
                async for piece, _ in synthesis.pieces():
                    encoder.encode(np.frombuffer(piece, dtype="<i2"))
            except EngineError as exc:
                wait = retry_after_s(exc)  # still queued when its max wait passed: refused
                if wait is not None:
                    return fail(
                        429, "overloaded", public_message(exc), {"Retry-After": str(max(1, math.ceil(wait)))}
                    )
                return fail(500, error_code(exc), public_message(exc))
            finally:
                watcher.cancel()
            return Response(encoder.finish(), media_type=media_type, headers=headers)
        return StreamingResponse(
            _file_bytes(synthesis, encoder, metrics),
            media_type=media_type,
            headers=headers,
            background=release,
        )

    return speech


async def _cancel_when_gone(request: Request, stream: SynthesisStream) -> None:
    """Cancel `stream` once the client disconnects (its body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.cancel()


async def _file_bytes(
    synthesis: _Synthesis, encoder: StreamEncoder, metrics: GatewayMetrics
) -> AsyncIterator[bytes]:
    """The file's bytes as the encoder makes them; an engine failure ends the stream short."""
    finished = False
    try:
        async for piece, _ in synthesis.pieces():
            data = encoder.encode(np.frombuffer(piece, dtype="<i2"))
            if data:
                yield data
        finished = True
        tail = encoder.finish()
        if tail:
            yield tail
    except EngineError as exc:  # the status is sent already: the stream ends short
        metrics.errors.labels(error_code(exc)).inc()
        log.warning("speech stream failed: %s", exc)
    finally:
        if not finished:
            encoder.close()


async def _sse_events(
    synthesis: _Synthesis, req: SpeechRequest, metrics: GatewayMetrics, encoder: StreamEncoder
) -> AsyncIterator[bytes]:
    rate = synthesis.engine_rate
    index = 0

    def delta(data: bytes) -> bytes:
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})

    try:
        async for piece, chunk in synthesis.pieces():
            if req.timestamps and chunk.words:
                words = []
                for w in chunk.words:
                    words.append(
                        {
                            "index": index,
                            "text": w.text,
                            "start_ms": round(w.start_sample * 1000 / rate),
                            "end_ms": round(w.end_sample * 1000 / rate),
                            "char_start": w.char_start,
                            "char_end": w.char_end,
                        }
                    )
                    index += 1
                yield _sse({"type": "speech.audio.words", "words": words})
            data = encoder.encode(np.frombuffer(piece, dtype="<i2"))
            if data:
                yield delta(data)
        tail = encoder.finish()
        if tail:
            yield delta(tail)
    except EngineError as exc:
        encoder.close()
        code = error_code(exc)
        metrics.errors.labels(code).inc()
        yield _sse(
            {"type": "error", "error": {"message": public_message(exc), "type": "server_error", "code": code}}
        )
        return
    except BaseException:
        encoder.close()
        raise
    duration_ms = round(synthesis.samples_out * 1000 / synthesis.out_rate)
    yield _sse(
        {
            "type": "speech.audio.done",
            "duration_ms": duration_ms,
            "sample_rate": synthesis.out_rate,
            "usage": {"input_characters": len(req.input)},
        }
    )
