"""Compressed and container audio for the compatible dialects, made as the PCM comes: 16-bit mono
PCM in, the bytes of the file out, a piece at a time.

MP3 (LAME), Ogg Opus, AAC (ADTS) and WAV are muxed by PyAV's bundled FFmpeg into a sink that
cannot seek, so each piece goes out as soon as the muxer writes it: WAV then carries 0xFFFFFFFF
as its sizes, as streamed WAV does, and the Ogg muxer closes a page every 20 ms. FLAC is written
whole by libsndfile (soundfile) at the end, because its header holds the length and readers such
as libsndfile refuse a FLAC stream without it. Raw PCM passes through.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Final, Literal

import av
import numpy as np
import numpy.typing as npt
import soundfile as sf

Container = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
CONTAINERS: Final[tuple[Container, ...]] = ("mp3", "opus", "aac", "flac", "wav", "pcm")
MEDIA_TYPES: Final[dict[Container, str]] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

# (muxer, codec, default bit rate) for the formats PyAV makes
_MUXED: Final[dict[Container, tuple[str, str, int | None]]] = {
    "mp3": ("mp3", "libmp3lame", 128_000),
    "opus": ("ogg", "libopus", 64_000),
    "aac": ("adts", "aac", 96_000),
    "wav": ("wav", "pcm_s16le", None),
}
OPUS_RATES: Final = (8000, 12000, 16000, 24000, 48000)
MP3_RATES: Final = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


class EncodingError(ValueError):
    """A format this module cannot make at the rate asked for."""


def check_format(container: Container, sample_rate: int) -> None:
    if container == "opus" and sample_rate not in OPUS_RATES:
        raise EncodingError(f"opus is made at {', '.join(map(str, OPUS_RATES))} Hz, not {sample_rate}")
    if container == "mp3" and sample_rate not in MP3_RATES:
        raise EncodingError(f"mp3 is made at {', '.join(map(str, MP3_RATES))} Hz, not {sample_rate}")


class _Sink:
    """Where the muxer writes: bytes collected until taken; not seekable, so nothing is rewritten."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._pieces.append(bytes(data))
        return len(data)

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        data = b"".join(self._pieces)
        self._pieces.clear()
        return data


@dataclass
class StreamEncoder:
    """One file's encoder: `encode(pcm)` returns what the file gained, `finish()` the rest."""

    container: Container
    sample_rate: int
    bit_rate: int | None = None

    def __post_init__(self) -> None:
        check_format(self.container, self.sample_rate)
        self._pts = 0
        self._whole: list[npt.NDArray[np.int16]] = []  # FLAC: kept until finish()
        self._sink = _Sink()
        self._output: av.container.OutputContainer | None = None
        self._stream: av.audio.stream.AudioStream | None = None
        muxed = _MUXED.get(self.container)
        if muxed is None:
            return
        muxer, codec, default_rate = muxed
        options = {"page_duration": "20000"} if muxer == "ogg" else {}  # µs: a page every 20 ms
        self._output = av.open(self._sink, mode="w", format=muxer, options=options)
        stream = self._output.add_stream(codec, rate=self.sample_rate, layout="mono")
        assert isinstance(stream, av.audio.stream.AudioStream)
        if default_rate is not None:
            stream.bit_rate = self.bit_rate or default_rate
        self._stream = stream

    def encode(self, pcm: npt.NDArray[np.int16]) -> bytes:
        if not len(pcm):
            return b""
        if self.container == "pcm":
            return pcm.astype("<i2", copy=False).tobytes()
        if self.container == "flac":
            self._whole.append(pcm.copy())
            return b""
        assert self._output is not None and self._stream is not None
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm, dtype=np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(pcm)
        for packet in self._stream.encode(frame):
            self._output.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if self.container == "pcm":
            return b""
        if self.container == "flac":
            buffer = io.BytesIO()
            audio = np.concatenate(self._whole) if self._whole else np.zeros(0, np.int16)
            sf.write(buffer, audio, self.sample_rate, format="FLAC", subtype="PCM_16")
            self._whole.clear()
            return buffer.getvalue()
        assert self._output is not None and self._stream is not None
        for packet in self._stream.encode(None):
            self._output.mux(packet)
        output, self._output = self._output, None
        output.close()
        return self._sink.take()

    def close(self) -> None:
        """Give up (the client left): free the muxer without writing its end."""
        output, self._output = self._output, None
        if output is not None:
            with contextlib.suppress(Exception):  # a half-written stream may refuse its trailer
                output.close()
