"""Voice prompts for clones (speaker embedding + reference codes), computed once per clip.

A clip's prompt is cached under a hash of its content (samples, layout and rate as received), in an
LRU bounded by bytes; named voices (`register`) are pinned outside the LRU, so a voice registered
once costs nothing before its first frame afterwards. Thread-safe: concurrent requests for the same
new clip compute it once, the others wait for that result.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from torch import Tensor

from engine.qwen3.reference_audio import prepare_reference_audio

Audio = npt.NDArray[np.float32]


@dataclass(frozen=True)
class VoicePrompt:
    speaker_embedding: Tensor  # [enc_dim], the talker's dtype and device
    ref_codes: Tensor | None  # [frames, 16] for in-context cloning; None = x-vector only
    ref_text: str | None  # transcript of the clip (needed with ref_codes)
    key: str  # content hash of the clip

    @property
    def nbytes(self) -> int:
        total = self.speaker_embedding.numel() * self.speaker_embedding.element_size()
        if self.ref_codes is not None:
            total += self.ref_codes.numel() * self.ref_codes.element_size()
        return total


def clip_key(audio: npt.NDArray[Any], sample_rate: int) -> str:
    """Content hash of a clip as received (same samples, layout and rate -> same key)."""
    arr = np.ascontiguousarray(audio)
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{arr.dtype.str}|{arr.shape}|{int(sample_rate)}|".encode())
    h.update(arr.data)
    return h.hexdigest()


def _wants_codes(text: str | None) -> bool:
    return bool(text and text.strip())


class VoicePromptCache:
    def __init__(
        self,
        embed: Callable[[Audio], Tensor],
        encode: Callable[[Audio], Tensor] | None,
        max_bytes: int = 64 << 20,
    ) -> None:
        """embed: 24 kHz clip -> speaker embedding; encode: 24 kHz clip -> reference codes (None
        when the model has no encoder: x-vector voices only)."""
        self._embed, self._encode = embed, encode
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, VoicePrompt] = OrderedDict()
        self._lru_bytes = 0
        self._pending: dict[tuple[str, bool], Future[VoicePrompt]] = {}
        self._named: dict[str, VoicePrompt] = {}
        self.hits = self.misses = 0

    @classmethod
    def for_models(
        cls, speaker_encoder: Any, speech_tokenizer: Any | None, max_bytes: int = 64 << 20
    ) -> VoicePromptCache:
        encode = speech_tokenizer.encode if speech_tokenizer is not None else None
        return cls(speaker_encoder.embed, encode, max_bytes)

    # ---- one-off clips -----------------------------------------------------------------------

    def prompt_for(self, audio: npt.NDArray[Any], sample_rate: int, text: str | None = None) -> VoicePrompt:
        """The prompt for a clip (with reference codes when `text` is given); InvalidAudio if unusable."""
        key = clip_key(audio, sample_rate)
        codes = _wants_codes(text)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None and (hit.ref_codes is not None or not codes):
                self._lru.move_to_end(key)
                self.hits += 1
                return self._with_text(hit, text)
            future = self._pending.get((key, codes))
            owner = future is None
            if owner:
                future = self._pending[(key, codes)] = Future()
                self.misses += 1
        assert future is not None
        if not owner:
            return self._with_text(future.result(), text)
        try:
            prompt = self._compute(key, audio, sample_rate, codes, hit)
        except BaseException as exc:
            with self._lock:
                del self._pending[(key, codes)]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._pending[(key, codes)]
            self._store(prompt)
        future.set_result(prompt)
        return self._with_text(prompt, text)

    def _compute(
        self, key: str, audio: npt.NDArray[Any], sample_rate: int, codes: bool, known: VoicePrompt | None
    ) -> VoicePrompt:
        clip = prepare_reference_audio(audio, sample_rate)
        embedding = known.speaker_embedding if known is not None else self._embed(clip)
        ref_codes = None
        if codes:
            if self._encode is None:
                raise RuntimeError(
                    "this model has no reference encoder; use an x-vector voice (no transcript)"
                )
            ref_codes = self._encode(clip)
        return VoicePrompt(embedding, ref_codes, None, key)

    @staticmethod
    def _with_text(prompt: VoicePrompt, text: str | None) -> VoicePrompt:
        if prompt.ref_codes is None or not _wants_codes(text):
            return replace(prompt, ref_codes=None, ref_text=None)
        return replace(prompt, ref_text=text)

    def _store(self, prompt: VoicePrompt) -> None:
        old = self._lru.pop(prompt.key, None)
        if old is not None:
            self._lru_bytes -= old.nbytes
        if prompt.nbytes > self.max_bytes:
            return
        self._lru[prompt.key] = prompt
        self._lru_bytes += prompt.nbytes
        while self._lru_bytes > self.max_bytes:
            _, evicted = self._lru.popitem(last=False)
            self._lru_bytes -= evicted.nbytes

    # ---- named voices ------------------------------------------------------------------------

    def register(
        self, voice_id: str, audio: npt.NDArray[Any], sample_rate: int, text: str | None
    ) -> VoicePrompt:
        """Compute (or reuse) a clip's prompt and keep it under `voice_id` until unregistered."""
        prompt = self.prompt_for(audio, sample_rate, text)
        with self._lock:
            self._named[voice_id] = prompt
        return prompt

    def voice(self, voice_id: str) -> VoicePrompt | None:
        with self._lock:
            return self._named.get(voice_id)

    def unregister(self, voice_id: str) -> bool:
        with self._lock:
            return self._named.pop(voice_id, None) is not None

    def __contains__(self, voice_id: object) -> bool:
        with self._lock:
            return voice_id in self._named

    # ---- figures -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "voice_cache_entries": len(self._lru),
                "voice_cache_bytes": self._lru_bytes,
                "voice_cache_hits": self.hits,
                "voice_cache_misses": self.misses,
                "voices_registered": len(self._named),
            }
