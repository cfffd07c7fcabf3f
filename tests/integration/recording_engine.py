"""A real engine with a tap: every chunk each stream hands the gateway is also kept, by request id, so
that a test knows what the gateway would have sent of an utterance had nothing happened to it (the
eSpeak engine does not repeat itself exactly from one utterance to the next, so speaking the text
again is no reference)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from engine.api import AudioChunk, ChunkListener, Engine, QueuePosition, SynthesisRequest, SynthesisStream
from gateway.messages import Encoding
from gateway.packets import OutputFormat, Packetiser


class _Tap:
    def __init__(self, listener: ChunkListener, sink: list[AudioChunk]) -> None:
        self._listener = listener
        self._sink = sink

    def chunk(self, chunk: AudioChunk) -> None:
        self._sink.append(chunk)
        self._listener.chunk(chunk)

    def end(self) -> None:
        self._listener.end()

    def fail(self, error: BaseException) -> None:
        self._listener.fail(error)


class _TappedStream(SynthesisStream):
    def __init__(self, inner: SynthesisStream, sink: list[AudioChunk]) -> None:
        self._inner = inner
        self._sink = sink
        self.request_id = inner.request_id

    def push(self, segment: Any) -> None:
        self._inner.push(segment)

    def close_text(self) -> None:
        self._inner.close_text()

    def cancel(self) -> None:
        self._inner.cancel()

    def listen(self, listener: ChunkListener) -> bool:
        return self._inner.listen(_Tap(listener, self._sink))

    def set_word_alignment(self, mode: str) -> None:
        self._inner.set_word_alignment(mode)

    def queue_position(self) -> QueuePosition | None:
        return self._inner.queue_position()

    def queue_wait_s(self) -> float:
        return self._inner.queue_wait_s()

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[AudioChunk]:
        async for chunk in self._inner:
            self._sink.append(chunk)
            yield chunk


class RecordingEngine:
    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.info = inner.info
        self.chunks: dict[str, list[AudioChunk]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def load(self) -> Any:
        return self.inner.load()

    def open(self, request: SynthesisRequest) -> SynthesisStream:
        stream = self.inner.open(request)
        return _TappedStream(stream, self.chunks.setdefault(request.request_id, []))

    def expected_payload(self, request_id: str, encoding: Encoding, rate: int, packet_ms: int = 20) -> bytes:
        """The payloads the gateway sends for this request when nothing stops it."""
        packetiser = Packetiser(0, OutputFormat(encoding, rate, packet_ms), self.info.sample_rate)
        out: list[bytes] = []
        chunks = self.chunks[request_id]
        for chunk in chunks:
            out += [p.payload for p in packetiser.push(chunk.samples, final=chunk.final)]
        if not packetiser.finished:
            out += [p.payload for p in packetiser.push(np.zeros(0, np.float32), final=True)]
        return b"".join(out)
