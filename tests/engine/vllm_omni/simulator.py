"""A SIMULATOR of vLLM-Omni's documented speech-serving API, for testing Cadence's vllm-omni backend.

It is not vLLM-Omni and synthesises no speech: each sentence becomes a tone whose length follows
its text. What it reproduces is the wire behaviour of the real server's endpoints:

* `WS /v1/audio/speech/stream`: `session.config` first (within a config timeout; invalid ->
  `error` and close), `input.text` buffered until `input.done` (split_granularity "none"), which
  flushes one utterance and keeps the connection: with `stream_audio=true` + pcm, `audio.start`
  (deferred to the first chunk, with sample_rate/channels), binary s16le frames (the first chunk
  small, later ones larger), `audio.done {total_bytes, error}`, `session.done {utterance_index,
  total_sentences}`; with `word_timestamps=true` (needs the forced aligner) base64 `audio.chunk`
  frames and a trailing empty chunk carrying [{word, start_ms, end_ms}]; generation failures as
  `error` ("Generation failed for utterance U, sentence S: ...") between audio.start and
  audio.done; `session.config` replaceable between utterances; `session.close`; idle timeout.
* `POST /v1/audio/speech` with `stream=true, stream_format="audio"`: raw PCM over chunked HTTP;
  errors as vLLM's `{"error": {"message", "type", "param", "code"}}` bodies.
* `GET /health`, `GET /v1/models`, `GET /v1/audio/voices`.

Knobs (`SimulatorOptions`, changeable while it runs): audio speed (x real time), a slow start
before the first audio, errors and abrupt disconnects after N chunks, the WebSocket route absent,
and the crash vLLM-Omni shows when more requests run than its `--max-num-seqs` (every request in
flight fails with an EngineDeadError, all connections drop, /health answers 503 and new
WebSockets are refused with 503 until `restart()`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

SAMPLE_RATE = 24_000
FRAME = 1_920  # samples per 80 ms codec frame
LANGUAGES = {
    "Auto",
    "Chinese",
    "English",
    "Japanese",
    "Korean",
    "German",
    "French",
    "Russian",
    "Portuguese",
    "Spanish",
    "Italian",
}
CRASH_MESSAGE = (
    "EngineDeadError: EngineCore encountered an issue. See stack trace for the root cause."
    " (AssertionError: frames=37 < ref_context_size=72)"
)


@dataclass
class SimulatorOptions:
    voices: tuple[str, ...] = ("vivian", "serena", "ryan", "aiden")
    model: str = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
    speed: float = 50.0  # audio produced at this many times real time
    first_audio_delay_s: float = 0.0  # slow start: extra wait before a sentence's first chunk
    ms_per_char: float = 40.0  # audio length per character of text
    first_chunk_frames: int = 1  # initial_codec_chunk_frames
    chunk_frames: int = 4  # later chunks
    websocket: bool = True  # False: no /v1/audio/speech/stream route (handshake answered 403)
    forced_aligner: bool = False  # launched with --forced-aligner: word_timestamps allowed
    max_num_seqs: int = 64
    crash_over_capacity: bool = True  # more than max_num_seqs in flight -> the engine dies
    fail_after_chunks: int | None = None  # a generation error after this many chunks of a sentence
    disconnect_after_chunks: int | None = None  # drop the connection after this many chunks
    disconnect_times: int = 1_000_000  # how many connections the disconnect applies to
    idle_timeout_s: float = 30.0
    config_timeout_s: float = 10.0


def sentence_samples(text: str, ms_per_char: float) -> int:
    """The simulated audio length of a sentence: whole 80 ms frames, at least one."""
    frames = max(1, round(len(text.strip()) * ms_per_char / 80.0))
    return frames * FRAME


def sentence_pcm(text: str, ms_per_char: float) -> bytes:
    n = sentence_samples(text, ms_per_char)
    frequency = 180.0 + 10.0 * (sum(map(ord, text)) % 30)
    tone = 0.3 * np.sin(2 * np.pi * frequency * np.arange(n) / SAMPLE_RATE)
    return (tone * 32767).astype("<i2").tobytes()


def word_timestamps(text: str, total_samples: int) -> list[dict[str, Any]]:
    """What the simulated aligner says: words spread over the audio by character count."""
    words = text.split()
    chars = sum(len(w) for w in words) or 1
    out, done = [], 0
    total_ms = total_samples * 1000 / SAMPLE_RATE
    for word in words:
        start = total_ms * done / chars
        done += len(word)
        out.append(
            {"word": word.strip(".,!?;:"), "start_ms": round(start), "end_ms": round(total_ms * done / chars)}
        )
    return out


class GenerationFailed(Exception):
    pass


class Disconnect(Exception):
    pass


@dataclass
class SimulatorStats:
    ws_connections: int = 0
    http_requests: int = 0
    generations: int = 0
    active: int = 0
    peak_active: int = 0
    aborted: int = 0  # generations stopped because the client went away
    crashes: int = 0
    configs: list[dict[str, Any]] = field(default_factory=list)
    http_bodies: list[dict[str, Any]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    abort_times: list[float] = field(default_factory=list)


class VllmOmniSimulator:
    def __init__(self, options: SimulatorOptions | None = None) -> None:
        self.options = options or SimulatorOptions()
        self.stats = SimulatorStats()
        self.crashed = False
        self._disconnects_done = 0
        self._in_flight: set[asyncio.Event] = set()  # each generation's crash signal
        self._sockets: set[WebSocket] = set()
        self.app = Starlette(
            routes=[
                Route("/health", self.health),
                Route("/v1/models", self.models),
                Route("/v1/audio/voices", self.voices),
                Route("/v1/audio/speech", self.speech, methods=["POST"]),
                WebSocketRoute("/v1/audio/speech/stream", self.stream),
            ]
        )

    def restart(self) -> None:
        """The operator restarts the crashed server."""
        self.crashed = False

    # -- plain routes --------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.crashed else 200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.options.model, "object": "model"}]})

    async def voices(self, request: Request) -> Response:
        return JSONResponse({"voices": list(self.options.voices), "uploaded_voices": []})

    # -- generation (shared) ---------------------------------------------------------------------------
    def _check(self, params: dict[str, Any]) -> str | None:
        voice = params.get("voice")
        if (
            voice
            and voice.lower() not in {v.lower() for v in self.options.voices}
            and not params.get("ref_audio")
        ):
            return f"Invalid speaker '{voice}'. Supported: {', '.join(self.options.voices)}"
        language = params.get("language")
        if language and language not in LANGUAGES:
            return f"Invalid language '{language}'. Supported: {', '.join(sorted(LANGUAGES))}"
        if params.get("task_type") == "Base" and not params.get("ref_audio"):
            return "Base task requires 'ref_audio' for voice cloning"
        return None

    async def _chunks(self, text: str, connection_disconnects: bool) -> AsyncIterator[bytes]:
        """One sentence's PCM in chunks at the configured speed; failures and crashes on cue."""
        options = self.options
        crash = asyncio.Event()
        self._in_flight.add(crash)
        self.stats.generations += 1
        self.stats.texts.append(text)
        self.stats.active += 1
        self.stats.peak_active = max(self.stats.peak_active, self.stats.active)
        try:
            if self.stats.active > options.max_num_seqs and options.crash_over_capacity:
                await self._crash()
            pcm = sentence_pcm(text, options.ms_per_char)
            if options.first_audio_delay_s:
                await self._wait(crash, options.first_audio_delay_s)
            at, sent = 0, 0
            while at < len(pcm):
                frames = options.first_chunk_frames if sent == 0 else options.chunk_frames
                if options.fail_after_chunks is not None and sent >= options.fail_after_chunks:
                    raise GenerationFailed("simulated generation failure")
                if (
                    connection_disconnects
                    and options.disconnect_after_chunks is not None
                    and sent >= options.disconnect_after_chunks
                ):
                    raise Disconnect
                piece = pcm[at : at + frames * FRAME * 2]
                await self._wait(crash, len(piece) / 2 / SAMPLE_RATE / options.speed)
                at += len(piece)
                sent += 1
                yield piece
        finally:
            self.stats.active -= 1
            self._in_flight.discard(crash)

    async def _wait(self, crash: asyncio.Event, seconds: float) -> None:
        if crash.is_set():
            raise GenerationFailed(CRASH_MESSAGE)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(crash.wait(), seconds)
        if crash.is_set():
            raise GenerationFailed(CRASH_MESSAGE)

    async def _crash(self) -> None:
        self.crashed = True
        self.stats.crashes += 1
        for signal in list(self._in_flight):
            signal.set()
        await asyncio.sleep(0)

        doomed = list(self._sockets)

        async def drop_all() -> None:  # the dying server takes its sockets with it, once the
            for _ in range(100):  # requests in flight have reported the error
                if not self._in_flight:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            for ws in doomed:
                with contextlib.suppress(Exception):
                    await ws.close(1011)

        asyncio.get_running_loop().create_task(drop_all())

    def _take_disconnect(self) -> bool:
        if (
            self.options.disconnect_after_chunks is None
            or self._disconnects_done >= self.options.disconnect_times
        ):
            return False
        self._disconnects_done += 1
        return True

    # -- WS /v1/audio/speech/stream --------------------------------------------------------------------
    async def stream(self, ws: WebSocket) -> None:
        if not self.options.websocket:
            await ws.close()  # no such route: the handshake is refused (403)
            return
        if self.crashed:
            await ws.send_denial_response(Response("engine dead", status_code=503))
            return
        await ws.accept()
        self.stats.ws_connections += 1
        self._sockets.add(ws)
        disconnects = self._take_disconnect()
        early: list[str] = []  # messages that arrived while a sentence was being generated
        config: dict[str, Any] | None = None
        buffer, utterance = "", 0
        try:
            while True:
                timeout = self.options.config_timeout_s if config is None else self.options.idle_timeout_s
                try:
                    raw = early.pop(0) if early else await asyncio.wait_for(ws.receive_text(), timeout)
                except TimeoutError:
                    await self._error(
                        ws,
                        "Timeout waiting for session.config"
                        if config is None
                        else "Idle timeout: no message received",
                    )
                    return
                try:
                    message = json.loads(raw)
                except ValueError:
                    await self._error(ws, "Invalid JSON message")
                    if config is None:
                        return
                    continue
                kind = message.get("type")
                if kind == "session.config":
                    if buffer:
                        await self._error(
                            ws,
                            "session.config cannot be applied while an utterance is in"
                            " progress; send input.done first",
                        )
                        continue
                    problem = self._config_problem(message)
                    if problem:
                        await self._error(ws, f"Invalid session config: {problem}")
                        if config is None:
                            return
                        continue
                    config = {k: v for k, v in message.items() if k != "type"}
                    self.stats.configs.append(config)
                elif config is None:
                    await self._error(ws, f"Expected session.config, got: {kind}")
                    return
                elif kind == "input.text":
                    buffer += str(message.get("text", ""))
                elif kind == "input.done":
                    sentences = 0
                    if buffer.strip():
                        await self._utterance(ws, config, buffer.strip(), utterance, disconnects, early)
                        sentences = 1
                    buffer = ""
                    await ws.send_json(
                        {"type": "session.done", "utterance_index": utterance, "total_sentences": sentences}
                    )
                    utterance += 1
                elif kind == "session.close":
                    await ws.close()
                    return
                else:
                    await self._error(ws, f"Unknown message type: {kind}")
        except (WebSocketDisconnect, RuntimeError, Disconnect):
            return
        finally:
            self._sockets.discard(ws)

    def _config_problem(self, config: dict[str, Any]) -> str | None:
        if config.get("stream_audio") and config.get("response_format", "wav") != "pcm":
            return "WebSocket streaming audio (stream_audio=true) requires response_format='pcm'."
        if config.get("stream_audio") and config.get("speed", 1.0) not in (None, 1.0):
            return "WebSocket stream_audio=true currently requires speed=1.0"
        if config.get("split_granularity", "none") not in ("none", "sentence", "clause"):
            return "split_granularity must be none, sentence or clause"
        return None

    async def _utterance(
        self,
        ws: WebSocket,
        config: dict[str, Any],
        text: str,
        utterance: int,
        disconnects: bool,
        early: list[str],
    ) -> None:
        start = {
            "type": "audio.start",
            "utterance_index": utterance,
            "sentence_index": 0,
            "sentence_text": text,
            "format": config.get("response_format", "wav"),
        }
        aligned = bool(config.get("word_timestamps"))
        if aligned:
            if not self.options.forced_aligner:
                await self._error(
                    ws,
                    "word_timestamps=true but the server was launched without --forced-aligner;"
                    " either restart the server with that flag or set word_timestamps=false"
                    " in session.config.",
                )
                return
            start["word_timestamps"] = True
        start_sent, total, failed = False, 0, False

        async def send_start() -> None:
            nonlocal start_sent
            if not start_sent:
                start_sent = True
                await ws.send_json({**start, "sample_rate": SAMPLE_RATE, "channels": 1})

        watcher = asyncio.get_running_loop().create_task(self._client_gone(ws, early))
        try:
            problem = self._check(config)
            if problem:
                raise GenerationFailed(problem)
            async for piece in self._chunks(text, disconnects):
                if watcher.done():
                    raise WebSocketDisconnect(1006)
                await send_start()
                total += len(piece)
                if aligned:
                    await ws.send_json(
                        {
                            "type": "audio.chunk",
                            "utterance_index": utterance,
                            "sentence_index": 0,
                            "audio_b64": base64.b64encode(piece).decode(),
                            "timestamps": None,
                        }
                    )
                else:
                    await ws.send_bytes(piece)
            if aligned:
                await ws.send_json(
                    {
                        "type": "audio.chunk",
                        "utterance_index": utterance,
                        "sentence_index": 0,
                        "audio_b64": "",
                        "timestamps": word_timestamps(text, total // 2),
                    }
                )
        except (WebSocketDisconnect, RuntimeError):
            self.stats.aborted += 1
            self.stats.abort_times.append(time.monotonic())
            raise
        except Disconnect:
            with contextlib.suppress(Exception):
                await ws.close(1011)
            raise
        except GenerationFailed as exc:
            failed = True
            await send_start()
            payload: dict[str, Any] = {
                "type": "error",
                "message": f"Generation failed for utterance {utterance}, sentence 0: {exc}",
            }
            if total:
                payload.update(partial_audio=True, action="discard")
            await ws.send_json(payload)
        finally:
            watcher.cancel()
        await send_start()
        await ws.send_json(
            {
                "type": "audio.done",
                "utterance_index": utterance,
                "sentence_index": 0,
                "total_bytes": total,
                "error": failed,
            }
        )

    async def _client_gone(self, ws: WebSocket, early: list[str]) -> None:
        """Notice the client closing while a generation runs (the real server notices on its next
        send); other messages are kept for the session loop."""
        with contextlib.suppress(Exception):
            while True:
                message = await ws.receive()
                if message.get("type") == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    early.append(message["text"])

    @staticmethod
    async def _error(ws: WebSocket, message: str) -> None:
        with contextlib.suppress(Exception):
            await ws.send_json({"type": "error", "message": message})

    # -- POST /v1/audio/speech -------------------------------------------------------------------------
    async def speech(self, request: Request) -> Response:
        if self.crashed:
            return _error_response("EngineDeadError: the engine is dead", 500)
        self.stats.http_requests += 1
        try:
            body = await request.json()
        except ValueError:
            return _error_response("Invalid JSON body", 400)
        self.stats.http_bodies.append(body)
        text = str(body.get("input", "")).strip()
        if not text:
            return _error_response("input cannot be empty", 400)
        streaming = body.get("stream") or body.get("stream_format") in ("audio", "sse")
        if streaming and body.get("response_format", "wav") not in ("pcm", "wav"):
            return _error_response("Streaming requires response_format='pcm' or 'wav'.", 400)
        problem = self._check(body)
        if problem:
            return _error_response(problem, 400)
        if body.get("stream_format") != "audio":
            return _error_response("this simulator streams only stream_format='audio'", 400)
        disconnects = self._take_disconnect()

        async def pcm() -> AsyncIterator[bytes]:
            try:
                async for piece in self._chunks(text, disconnects):
                    yield piece
            except asyncio.CancelledError:
                self.stats.aborted += 1
                self.stats.abort_times.append(time.monotonic())
                raise

        return StreamingResponse(pcm(), media_type="audio/pcm")


def _error_response(message: str, status: int) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


@dataclass
class RunningSimulator:
    simulator: VllmOmniSimulator
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def options(self) -> SimulatorOptions:
        return self.simulator.options

    @property
    def stats(self) -> SimulatorStats:
        return self.simulator.stats


@contextlib.contextmanager
def run_simulator(options: SimulatorOptions | None = None) -> Iterator[RunningSimulator]:
    """The simulator under uvicorn on a free loopback port, in a thread with its own event loop."""
    simulator = VllmOmniSimulator(options)
    server = uvicorn.Server(
        uvicorn.Config(
            simulator.app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            ws_ping_interval=None,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the vLLM-Omni simulator did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield RunningSimulator(simulator, port)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
