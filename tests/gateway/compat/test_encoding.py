"""Streaming encoders: every container decodes back to the PCM's length, and the muxed ones give
bytes before the end."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile as sf

from gateway.compat.encoding import CONTAINERS, EncodingError, StreamEncoder

RATE = 24000


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)


def decoded_samples(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        return sum(frame.samples * RATE // frame.sample_rate for frame in container.decode(audio=0))


@pytest.mark.parametrize("container", ["mp3", "opus", "aac", "wav"])
def test_muxed_formats_stream_and_decode(container: str) -> None:
    encoder = StreamEncoder(container, RATE)  # type: ignore[arg-type]
    pcm = tone(1.0)
    pieces = [encoder.encode(pcm[i : i + 2400]) for i in range(0, len(pcm), 2400)]
    assert sum(1 for p in pieces[:-1] if p) >= 5  # bytes come while the audio is still coming
    data = b"".join(pieces) + encoder.finish()
    # codec delay and padding: at most a couple of frames (AAC 1024, MP3 1152 samples, Opus 20 ms)
    assert abs(decoded_samples(data) - len(pcm)) <= 2 * 1152


def test_flac_is_whole_and_exact() -> None:
    encoder = StreamEncoder("flac", RATE)
    pcm = tone(0.5)
    assert encoder.encode(pcm) == b""
    audio, rate = sf.read(io.BytesIO(encoder.finish()), dtype="int16")
    assert rate == RATE and np.array_equal(audio, pcm)


def test_pcm_passes_through() -> None:
    pcm = tone(0.1)
    encoder = StreamEncoder("pcm", RATE)
    assert encoder.encode(pcm) == pcm.astype("<i2").tobytes() and encoder.finish() == b""


def test_rates_the_codec_lacks_are_refused() -> None:
    with pytest.raises(EncodingError, match="opus"):
        StreamEncoder("opus", 44100)
    assert set(CONTAINERS) == {"mp3", "opus", "aac", "flac", "wav", "pcm"}


def test_close_without_finish_frees_the_muxer() -> None:
    encoder = StreamEncoder("mp3", RATE)
    encoder.encode(tone(0.2))
    encoder.close()
    encoder.close()  # idempotent
