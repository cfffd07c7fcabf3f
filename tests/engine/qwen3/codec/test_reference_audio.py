"""Reference clip validation, mixing and resampling (engine/qwen3/reference_audio.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from engine.api import InvalidAudio, InvalidRequest
from engine.qwen3.reference_audio import (
    TARGET_RATE,
    prepare_reference_audio,
    speech_seconds,
)


def tone(seconds: float, rate: int, freq: float = 440.0, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def dominant_hz(audio: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(audio))
    return float(np.fft.rfftfreq(audio.size, 1 / rate)[spectrum.argmax()])


@pytest.mark.parametrize(
    ("fmt", "subtype"), [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"), ("WAV", "FLOAT")]
)
def test_decoded_files_become_24k_mono(fmt: str, subtype: str | None) -> None:
    stereo = np.stack([tone(2.0, 48000, 300.0), tone(2.0, 48000, 300.0)], axis=1)
    samples, rate = soundfile.read(io.BytesIO(encode(stereo, 48000, fmt, subtype)), dtype="float32")
    out = prepare_reference_audio(samples, rate)
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(out.size - 2 * TARGET_RATE) <= 2400  # lossy codecs may pad a little
    assert abs(dominant_hz(out, TARGET_RATE) - 300.0) < 2.0
    assert 0.25 < np.abs(out).max() < 0.35


def test_stereo_is_mixed_and_layouts_are_understood() -> None:
    left, right = tone(1.5, 24000, 200.0), tone(1.5, 24000, 500.0)
    frames_first = prepare_reference_audio(np.stack([left, right], axis=1), 24000)
    channels_first = prepare_reference_audio(np.stack([left, right]), 24000)
    np.testing.assert_allclose(frames_first, (left + right) / 2, atol=1e-7)
    np.testing.assert_array_equal(frames_first, channels_first)


def test_integer_pcm_is_scaled_and_16k_is_resampled() -> None:
    pcm = (tone(2.0, 16000, 250.0) * 32767).astype(np.int16)
    out = prepare_reference_audio(pcm, 16000)
    assert out.size == 2 * TARGET_RATE
    assert 0.28 < np.abs(out).max() < 0.32
    assert abs(dominant_hz(out, TARGET_RATE) - 250.0) < 1.0


def test_24k_float_passes_through_unchanged() -> None:
    audio = tone(3.0, 24000)
    np.testing.assert_array_equal(prepare_reference_audio(audio, 24000), audio)


def test_over_full_scale_is_rescaled() -> None:
    out = prepare_reference_audio(tone(2.0, 24000) * 1000, 24000)
    assert np.abs(out).max() == pytest.approx(1.0, abs=1e-6)


def test_speech_span_ignores_leading_and_trailing_silence() -> None:
    clip = np.concatenate([np.zeros(24000 * 5), tone(2.0, 24000), np.zeros(24000 * 5)]).astype(np.float32)
    assert speech_seconds(clip) == pytest.approx(2.0, abs=0.05)
    assert prepare_reference_audio(clip, 24000).size == clip.size  # accepted, not trimmed


@pytest.mark.parametrize(
    ("audio", "rate", "message"),
    [
        (tone(0.6, 24000), 24000, r"only 0\.6 s of speech; at least 1 s"),
        (
            np.concatenate([np.zeros(48000), tone(0.5, 24000), np.zeros(48000)]),
            24000,
            r"only 0\.5 s of speech",
        ),
        (tone(35.0, 16000), 16000, r"35\.0 s of speech; at most 30 s"),
        (tone(70.0, 8000), 8000, r"70\.0 s long; send at most 60 s"),
        (np.zeros(48000, dtype=np.float32), 24000, "silent"),
        (tone(2.0, 24000, level=1e-4), 24000, "silent"),
        (np.array([], dtype=np.float32), 24000, "empty"),
        (np.where(np.arange(48000) == 100, np.nan, 0.1).astype(np.float32), 24000, "NaN or infinity"),
        (np.full(48000, np.inf, dtype=np.float32), 24000, "NaN or infinity"),
        (tone(2.0, 24000), 1, r"sample rate \(1 Hz\) is not plausible"),
        (tone(2.0, 24000), 10_000_000, "not plausible"),
        (np.zeros((100, 100, 2), dtype=np.float32), 24000, "unexpected shape"),
        (np.ones(48000, dtype=bool), 24000, "unsupported sample type"),
    ],
    ids=[
        "short",
        "short-with-silence",
        "long-speech",
        "long-clip",
        "zeros",
        "hiss",
        "empty",
        "nan",
        "inf",
        "rate-1",
        "rate-10M",
        "3d",
        "bool",
    ],
)
def test_bad_clips_are_refused_with_a_reason(audio: np.ndarray, rate: int, message: str) -> None:
    with pytest.raises(InvalidAudio, match=message) as info:
        prepare_reference_audio(audio, rate)
    assert isinstance(info.value, InvalidRequest) and info.value.code == "invalid_audio"


@pytest.mark.parametrize("rate", [16000, 44100, 48000])
def test_resampling_matches_upstream_librosa(rate: int) -> None:
    librosa = pytest.importorskip("librosa")
    audio = (tone(2.0, rate, 220.0) + tone(2.0, rate, 3100.0, level=0.1)).astype(np.float32)
    expected = librosa.resample(audio, orig_sr=rate, target_sr=TARGET_RATE)
    out = prepare_reference_audio(audio, rate)
    assert abs(out.size - expected.size) <= 1  # librosa rounds the length up and zero-pads
    n = min(out.size, expected.size)
    np.testing.assert_allclose(out[:n], expected[:n], atol=1e-6, rtol=0)
