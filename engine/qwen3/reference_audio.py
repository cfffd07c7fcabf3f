"""Reference clips for voice clones: check, mix to mono, resample to 24 kHz.

Takes an array with its sample rate (the gateway decodes uploaded files). Refuses, with
`InvalidAudio` and a message a person can act on, clips that cannot serve as a voice prompt:
empty, non-finite samples, implausible sample rates, silence only, under 1 s or over 30 s of speech. The audio itself is passed on unchanged apart
from the mono mix, a rescale when samples exceed full scale, and the resampling.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import soxr

from engine.api import InvalidAudio

TARGET_RATE = 24000
MIN_RATE, MAX_RATE = 4000, 384000
MIN_SPEECH_S, MAX_SPEECH_S = 1.0, 30.0
MAX_CLIP_S = 60.0  # whole clip, silence included
MAX_CHANNELS = 8
SILENCE_DBFS = -55.0  # a clip whose loudest 20 ms stays below this is treated as silence
SPEECH_BELOW_PEAK_DB = 35.0  # frames this far below the loudest still count as sound
FRAME_S = 0.02

Audio = npt.NDArray[np.float32]


def _to_float(audio: npt.NDArray[np.generic]) -> npt.NDArray[np.float64]:
    if audio.dtype.kind == "f":
        return audio.astype(np.float64, copy=False)
    half_range = float(2 ** (8 * audio.dtype.itemsize - 1))  # full scale of integer PCM
    if audio.dtype.kind == "i":
        return audio.astype(np.float64) / half_range
    if audio.dtype.kind == "u":
        return (audio.astype(np.float64) - half_range) / half_range
    raise InvalidAudio(f"The reference audio has an unsupported sample type ({audio.dtype}).")


def _to_mono(audio: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    if audio.ndim == 1:
        return audio
    if audio.ndim == 2:
        if audio.shape[1] <= MAX_CHANNELS:  # [frames, channels], as soundfile reads it
            return audio.mean(axis=1)
        if audio.shape[0] <= MAX_CHANNELS:  # [channels, frames]
            return audio.mean(axis=0)
    raise InvalidAudio(
        f"The reference audio has an unexpected shape {audio.shape}; send mono or stereo audio."
    )


def speech_seconds(audio: Audio, rate: int = TARGET_RATE) -> float:
    """Seconds from the first to the last 20 ms frame with sound in it (0.0 for silence)."""
    hop = max(1, int(rate * FRAME_S))
    n = audio.size // hop
    if n == 0:
        return 0.0
    rms = np.sqrt(np.mean(np.square(audio[: n * hop].reshape(n, hop), dtype=np.float64), axis=1))
    loudest = float(rms.max())
    if loudest < 10 ** (SILENCE_DBFS / 20):
        return 0.0
    active = np.flatnonzero(
        rms >= max(10 ** (SILENCE_DBFS / 20), loudest * 10 ** (-SPEECH_BELOW_PEAK_DB / 20))
    )
    return float((active[-1] - active[0] + 1) * hop / rate)


def prepare_reference_audio(audio: npt.NDArray[np.generic], sample_rate: int) -> Audio:
    """Check a reference clip and return it as mono float32 at 24 kHz."""
    audio = np.asarray(audio)
    if not MIN_RATE <= int(sample_rate) <= MAX_RATE:
        raise InvalidAudio(
            f"The reference audio's sample rate ({sample_rate} Hz) is not plausible; "
            f"use a rate between {MIN_RATE // 1000} and {MAX_RATE // 1000} kHz."
        )
    mono = _to_mono(_to_float(audio))
    if mono.size == 0:
        raise InvalidAudio("The reference audio is empty.")
    if not np.isfinite(mono).all():
        raise InvalidAudio("The reference audio contains invalid samples (NaN or infinity).")
    seconds = mono.size / sample_rate
    if seconds > MAX_CLIP_S:
        raise InvalidAudio(
            f"The reference audio is {seconds:.1f} s long; send at most {MAX_CLIP_S:.0f} s "
            f"(3 to 10 s of clear speech works best)."
        )
    peak = float(np.abs(mono).max())
    if peak > 1.0:
        mono = mono / peak
    out = np.ascontiguousarray(mono, dtype=np.float32)
    if sample_rate != TARGET_RATE:  # float32 soxr HQ, as upstream's librosa.resample does it
        out = np.ascontiguousarray(
            soxr.resample(out, sample_rate, TARGET_RATE, quality="HQ"), dtype=np.float32
        )
    speech = speech_seconds(out)
    if speech == 0.0:
        raise InvalidAudio("The reference audio is silent; send a recording of the voice speaking.")
    if speech < MIN_SPEECH_S:
        raise InvalidAudio(
            f"The reference audio has only {speech:.1f} s of speech; at least {MIN_SPEECH_S:.0f} s is "
            f"needed (3 to 10 s works best)."
        )
    if speech > MAX_SPEECH_S:
        raise InvalidAudio(
            f"The reference audio has {speech:.1f} s of speech; at most {MAX_SPEECH_S:.0f} s is allowed. "
            f"Trim it to a shorter passage."
        )
    return out
