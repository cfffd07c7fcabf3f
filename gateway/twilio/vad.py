"""The caller's side: an energy VAD on the inbound audio (threshold, attack, hang time), and the
per-call options that tune it and say whether speech barges in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from gateway.twilio.media import RATE


@dataclass(frozen=True, slots=True)
class TwilioOptions:
    vad_threshold_dbfs: float = -35.0  # an inbound frame louder than this counts as speech
    vad_attack_ms: int = 60  # speech this long starts a turn (and a barge-in)
    vad_hang_ms: int = 400  # quiet this long ends it
    barge_in_on_speech: bool = True

    def with_parameters(self, params: Mapping[str, Any]) -> TwilioOptions:
        """Per-call overrides from the `<Stream>`'s `<Parameter>`s (names as the fields)."""
        changes: dict[str, Any] = {}
        for name, kind in (("vad_threshold_dbfs", float), ("vad_attack_ms", int), ("vad_hang_ms", int)):
            if name in params:
                with contextlib.suppress(TypeError, ValueError):
                    changes[name] = kind(params[name])
        if "barge_in_on_speech" in params:
            changes["barge_in_on_speech"] = str(params["barge_in_on_speech"]).lower() not in (
                "0",
                "false",
                "no",
            )
        return replace(self, **changes)


def frame_dbfs(pcm: npt.NDArray[np.int16]) -> float:
    """RMS level of 16-bit samples in dB relative to full scale (-inf for digital silence)."""
    if len(pcm) == 0:
        return -math.inf
    rms = float(np.sqrt(np.mean(np.square(pcm.astype(np.float64)))))
    return 20.0 * math.log10(rms / 32768.0) if rms > 0 else -math.inf


class EnergyVad:
    """Speech starts after `attack_ms` of frames above the threshold, ends after `hang_ms` below."""

    def __init__(self, threshold_dbfs: float, attack_ms: int, hang_ms: int) -> None:
        self.threshold_dbfs = threshold_dbfs
        self.attack_ms = attack_ms
        self.hang_ms = hang_ms
        self.speaking = False
        self._loud_ms = 0.0
        self._quiet_ms = 0.0

    def feed(self, pcm: npt.NDArray[np.int16]) -> Literal["start", "stop"] | None:
        ms = len(pcm) * 1000 / RATE
        loud = frame_dbfs(pcm) > self.threshold_dbfs
        if not self.speaking:
            self._loud_ms = self._loud_ms + ms if loud else 0.0
            if self._loud_ms >= self.attack_ms:
                self.speaking, self._quiet_ms = True, 0.0
                return "start"
            return None
        self._quiet_ms = 0.0 if loud else self._quiet_ms + ms
        if self._quiet_ms >= self.hang_ms:
            self.speaking, self._loud_ms = False, 0.0
            return "stop"
        return None
