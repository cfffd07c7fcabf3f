"""The voice registry: `GET/POST/DELETE /v1/voices` — a reference clip and its transcript become a
voice id usable wherever a voice is named.

POST takes either a JSON body `{"name", "text", "audio": <base64 file>}` or the audio file itself
as the body with `?name=&text=` in the query (multipart forms are not taken). The upload is
size-limited before it is read whole. A large JSON body is parsed (gateway.bodies)
and its clip's base64 decoded off the event loop, since megabytes of either would hold up every
stream. The clip's header is checked before decoding (sample rate, channels, length), it is decoded
with soundfile off the event loop within `voice_decode_timeout_s`, and every bad clip gets a 400
that says what to fix: unreadable, empty, absurd sample rate, more than two channels, under 1 s, over 30 s, NaN or
infinite samples, silence. Stereo is mixed to mono.

Ids are made by the server (`v_` + 16 hex digits): nothing the client sends reaches a path. Names
are 1-100 printable characters. Voices belong to the key that made them: a key lists, deletes and
speaks in only its own (another key's id is answered as an unknown voice), and a token limited to
some voices registers and deletes none. The clip is kept (in memory, and as FLAC + JSON under
`voices_dir` when configured, re-registered with the engine at start-up) until the voice is
deleted, which releases it from the engine too; an engine that cannot clone (eSpeak) makes the
POST a 400 `invalid_request` saying so, while the checked clip is still stored (`"ready": false`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import soundfile as sf
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.api import Engine, EngineError
from gateway.auth import principal_of
from gateway.bodies import off_loop_if_large, parse_json_body
from gateway.config import GatewayConfig

log = logging.getLogger("cadence.voices")

MIN_RATE, MAX_RATE = 8_000, 192_000
MIN_SECONDS, MAX_SECONDS = 1.0, 30.0
MAX_CHANNELS = 2
SILENCE_PEAK = 10 ** (-50 / 20)  # -50 dBFS
MAX_NAME_CHARS = 100
MAX_TRANSCRIPT_CHARS = 2_000
VOICE_ID = re.compile(r"v_[0-9a-f]{16}")


class ClipError(Exception):
    """A clip or request that cannot make a voice; the message is for a person."""


@dataclass(slots=True)
class Voice:
    voice_id: str
    name: str
    owner: str
    text: str | None
    sample_rate: int
    audio: npt.NDArray[np.float32]
    created_at: float
    ready: bool = False  # the engine accepted it

    def to_wire(self) -> dict[str, Any]:
        return {
            "voice_id": self.voice_id,
            "name": self.name,
            "created_at": int(self.created_at),
            "duration_s": round(len(self.audio) / self.sample_rate, 3),
            "sample_rate": self.sample_rate,
            "transcript": self.text,
            "ready": self.ready,
        }


def check_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name.strip()) <= MAX_NAME_CHARS:
        raise ClipError(f"`name` must be 1 to {MAX_NAME_CHARS} characters")
    if any(not ch.isprintable() for ch in name):
        raise ClipError("`name` must not contain control characters")
    return name.strip()


def check_transcript(text: object) -> str | None:
    if text is None or text == "":
        return None
    if not isinstance(text, str) or len(text) > MAX_TRANSCRIPT_CHARS:
        raise ClipError(
            f"`text` (the clip's transcript) must be a string of at most {MAX_TRANSCRIPT_CHARS} characters"
        )
    return text


def decode_clip(data: bytes) -> tuple[npt.NDArray[np.float32], int]:
    """A reference clip file -> mono float32 samples and their rate, or ClipError saying why not."""
    if not data:
        raise ClipError("The audio file is empty.")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception:
        raise ClipError("The audio could not be read: send a WAV, FLAC or OGG file.") from None
    rate, channels, frames = int(info.samplerate), int(info.channels), int(info.frames)
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ClipError(f"The audio's sample rate ({rate} Hz) is not usable: send {MIN_RATE}-{MAX_RATE} Hz.")
    if channels > MAX_CHANNELS:
        raise ClipError(f"The audio has {channels} channels: send mono or stereo.")
    if 0 < frames and frames / rate > MAX_SECONDS + 0.5:
        raise ClipError(
            f"The clip is {frames / rate:.1f} s long: send at most {MAX_SECONDS:.0f} s of speech."
        )
    try:
        audio, rate = sf.read(
            io.BytesIO(data), dtype="float32", always_2d=True, frames=int((MAX_SECONDS + 1) * rate)
        )
    except Exception:
        raise ClipError("The audio file is damaged and could not be decoded.") from None
    if audio.size == 0:
        raise ClipError("The audio holds no samples.")
    if not np.isfinite(audio).all():
        raise ClipError("The audio holds invalid (NaN or infinite) samples.")
    mono = audio.mean(axis=1).astype(np.float32)
    seconds = len(mono) / rate
    if seconds < MIN_SECONDS:
        raise ClipError(f"The clip is {seconds:.2f} s long: send at least {MIN_SECONDS:.0f} s of speech.")
    if seconds > MAX_SECONDS + 0.5:
        raise ClipError(
            f"The clip is longer than {MAX_SECONDS:.0f} s: send at most {MAX_SECONDS:.0f} s of speech."
        )
    if float(np.abs(mono).max()) < SILENCE_PEAK:
        raise ClipError("The clip is silent: send a recording of someone speaking.")
    return mono, int(rate)


class VoiceRegistry:
    def __init__(self, engine: Engine, config: GatewayConfig, directory: str | None = None) -> None:
        self.engine = engine
        self.config = config
        self.directory = Path(directory) if directory else None
        self._voices: dict[str, Voice] = {}

    def get(self, voice_id: str) -> Voice | None:
        return self._voices.get(voice_id)

    def owned_by(self, owner: str) -> list[Voice]:
        return [v for v in self._voices.values() if v.owner == owner]

    def usable_by(self, owner: str, voice: str) -> bool:
        """Whether `owner` may speak in `voice`: a registered voice's id only for the key that made
        it, so that another key's ids (and deleted ones) answer as unknown names do; any other name
        is the engine's to judge."""
        if not VOICE_ID.fullmatch(voice):
            return True
        found = self._voices.get(voice)
        return found is not None and found.owner == owner

    async def add(self, owner: str, name: str, text: str | None, data: bytes) -> tuple[Voice, str | None]:
        """Check, store and register a clip; returns the voice and the engine's refusal, if any."""
        if len(self._voices) >= self.config.max_voices:
            raise ClipError(f"the registry holds at most {self.config.max_voices} voices; delete some first")
        try:
            audio, rate = await asyncio.wait_for(
                asyncio.to_thread(decode_clip, data), self.config.voice_decode_timeout_s
            )
        except TimeoutError:
            raise ClipError("The audio took too long to decode: send a shorter or simpler file.") from None
        voice = Voice(f"v_{secrets.token_hex(8)}", name, owner, text, rate, audio, time.time())
        refusal = await self._register(voice)
        self._voices[voice.voice_id] = voice
        await asyncio.to_thread(self._save, voice)  # FLAC and the disk, off the loop that streams audio
        return voice, refusal

    async def remove(self, voice_id: str) -> None:
        await self._forget(voice_id)
        if self.directory is not None:
            for suffix in (".flac", ".json"):
                (self.directory / f"{voice_id}{suffix}").unlink(missing_ok=True)

    async def load_saved(self) -> int:
        """Voices saved under `directory`, registered with the engine again (start-up)."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        for meta_path in sorted(self.directory.glob("v_*.json")):
            if not VOICE_ID.fullmatch(meta_path.stem):
                continue
            try:
                meta = json.loads(meta_path.read_text())
                audio, rate = sf.read(meta_path.with_suffix(".flac"), dtype="float32")
                voice = Voice(
                    meta_path.stem,
                    meta["name"],
                    meta["owner"],
                    meta.get("text"),
                    int(rate),
                    np.asarray(audio, np.float32),
                    float(meta["created_at"]),
                )
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                log.warning("skipping saved voice %s: %s", meta_path.stem, exc)
                continue
            await self._register(voice)
            self._voices[voice.voice_id] = voice
        return len(self._voices)

    async def _forget(self, voice_id: str) -> None:
        """Drop a voice here and from the engine, which otherwise keeps its prompt for good."""
        self._voices.pop(voice_id, None)
        try:
            await self.engine.unregister_voice(voice_id)
        except EngineError as exc:  # the voice is unusable through the gateway all the same
            log.warning("the engine kept voice %s: %s", voice_id, exc)

    async def _register(self, voice: Voice) -> str | None:
        try:
            await self.engine.register_voice(voice.voice_id, voice.audio, voice.sample_rate, voice.text)
        except EngineError as exc:
            if getattr(exc, "code", "") == "invalid_audio":
                raise ClipError(str(exc)) from None
            voice.ready = False
            return f"The engine {self.engine.info.name!r} cannot use this clip: {exc}"
        voice.ready = True
        return None

    def _save(self, voice: Voice) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        sf.write(self.directory / f"{voice.voice_id}.flac", voice.audio, voice.sample_rate, format="FLAC")
        meta = {"name": voice.name, "owner": voice.owner, "text": voice.text, "created_at": voice.created_at}
        (self.directory / f"{voice.voice_id}.json").write_text(json.dumps(meta, ensure_ascii=False))


def _error(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}, **extra}, status)


async def read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it passes `limit` bytes (nothing more is read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def make_voice_endpoints(registry: VoiceRegistry) -> tuple[Callable[[Request], Awaitable[Response]], ...]:
    config = registry.config

    async def collection(request: Request) -> Response:
        principal = principal_of(request)
        owner = principal.key_id
        if request.method == "GET":
            return JSONResponse(
                {
                    "voices": [v.to_wire() for v in registry.owned_by(owner)],
                    "presets": list(registry.engine.info.voices),
                }
            )
        if not principal.may_change_voices():
            return _error(403, "unauthorized", "a token limited to some voices may not register voices")
        # a JSON body carries the file as base64 (4/3 of it) and the fields; a raw body is the file
        json_body = request.headers.get("content-type", "").startswith("application/json")
        limit = config.max_voice_upload_bytes * 4 // 3 + 4096 if json_body else config.max_voice_upload_bytes
        body = await read_limited(request, limit)
        if body is None:
            return _error(
                413, "invalid_audio", f"uploads are limited to {config.max_voice_upload_bytes} bytes"
            )
        try:
            name, text, data = await _parse_upload(request, body, config.max_voice_upload_bytes)
            voice, refusal = await registry.add(owner, name, text, data)
        except ClipError as exc:
            code = "invalid_message" if str(exc).startswith("`") else "invalid_audio"
            return _error(400, code, str(exc))
        if refusal is not None:
            return _error(
                400,
                "invalid_request",
                f"{refusal}. The clip is valid and was stored as voice "
                f"{voice.voice_id!r}; it becomes usable with an engine that clones voices.",
                voice=voice.to_wire(),
            )
        return JSONResponse(voice.to_wire(), 201)

    async def item(request: Request) -> Response:
        voice_id = request.path_params["voice_id"]
        principal = principal_of(request)
        voice = registry.get(voice_id) if VOICE_ID.fullmatch(voice_id) else None
        # another key's voice is unknown before anything else, so no refusal tells it exists
        if voice is None or voice.owner != principal.key_id:
            return _error(404, "unknown_voice", f"no voice {voice_id[:40]!r}")
        if request.method == "DELETE" and not principal.may_change_voices():
            return _error(403, "unauthorized", "a token limited to some voices may not delete voices")
        if request.method == "DELETE":
            await registry.remove(voice_id)
            return JSONResponse({"voice_id": voice_id, "deleted": True})
        return JSONResponse(voice.to_wire())

    return collection, item


def _b64decode(encoded: str) -> bytes:
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ClipError("`audio` is not valid base64") from None


async def _parse_upload(request: Request, body: bytes, limit: int) -> tuple[str, str | None, bytes]:
    if request.headers.get("content-type", "").startswith("application/json"):
        try:
            fields = await parse_json_body(body)
        except ValueError:
            raise ClipError("`body`: not valid JSON") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("audio"), str):
            raise ClipError("`audio` (the clip file, base64) is required")
        data = await off_loop_if_large(_b64decode, fields["audio"])
        name, text = fields.get("name"), fields.get("text")
    else:  # the body is the file itself: nothing to parse or decode here
        data, name, text = body, request.query_params.get("name"), request.query_params.get("text")
    if len(data) > limit:
        raise ClipError(f"the audio file is larger than {limit} bytes")
    return check_name(name), check_transcript(text), data
