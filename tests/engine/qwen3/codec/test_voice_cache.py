"""VoicePromptCache: content-hash LRU with a byte budget, pinned named voices, thread safety."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from engine.api import InvalidAudio
from engine.qwen3.models.speaker import SpeakerEncoder
from engine.qwen3.voice_cache import VoicePromptCache, clip_key


def clip(seed: int, seconds: float = 2.0, rate: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * (100 + 10 * seed) * t)).astype(np.float32)


class Models:
    """Counting stand-ins for the speaker encoder and the reference encoder."""

    def __init__(self, dim: int = 16, delay: float = 0.0) -> None:
        self.dim, self.delay = dim, delay
        self.embeds = self.encodes = 0
        self.lock = threading.Lock()

    def embed(self, audio: np.ndarray) -> torch.Tensor:
        assert audio.dtype == np.float32 and audio.ndim == 1
        with self.lock:
            self.embeds += 1
        time.sleep(self.delay)
        return torch.full((self.dim,), float(audio.sum()))

    def encode(self, audio: np.ndarray) -> torch.Tensor:
        with self.lock:
            self.encodes += 1
        return torch.zeros(-(-audio.size // 1920), 16, dtype=torch.long)


def test_repeat_clip_costs_nothing() -> None:
    m = Models()
    cache = VoicePromptCache(m.embed, m.encode)
    first = cache.prompt_for(clip(1), 24000, "hello there")
    again = cache.prompt_for(clip(1).copy(), 24000, "hello there")
    assert (m.embeds, m.encodes) == (1, 1)
    assert again.ref_codes is not None and again.ref_codes.shape == (25, 16)
    assert torch.equal(first.speaker_embedding, again.speaker_embedding) and again.ref_text == "hello there"
    assert cache.stats()["voice_cache_hits"] == 1


def test_key_depends_on_content_and_rate() -> None:
    a = clip(1)
    assert clip_key(a, 24000) == clip_key(a.copy(), 24000)
    assert clip_key(a, 24000) != clip_key(a, 16000)
    b = a.copy()
    b[100] += 1e-3
    assert clip_key(a, 24000) != clip_key(b, 24000)


def test_xvector_only_then_icl_reuses_the_embedding() -> None:
    m = Models()
    cache = VoicePromptCache(m.embed, m.encode)
    xv = cache.prompt_for(clip(2), 24000, None)
    assert xv.ref_codes is None and xv.ref_text is None and m.encodes == 0
    icl = cache.prompt_for(clip(2), 24000, "words")
    assert icl.ref_codes is not None and (m.embeds, m.encodes) == (1, 1)
    back = cache.prompt_for(clip(2), 24000, "  ")  # a blank transcript means x-vector only
    assert back.ref_codes is None and (m.embeds, m.encodes) == (1, 1)


def test_lru_respects_the_byte_budget() -> None:
    m = Models(dim=256)  # 1 KiB of fp32 per x-vector prompt
    cache = VoicePromptCache(m.embed, m.encode, max_bytes=3 * 1024)
    for seed in range(3):
        cache.prompt_for(clip(seed), 24000)
    cache.prompt_for(clip(0), 24000)  # touch 0: 1 is now the oldest
    cache.prompt_for(clip(3), 24000)
    stats = cache.stats()
    assert stats["voice_cache_entries"] == 3 and stats["voice_cache_bytes"] <= 3 * 1024
    calls = m.embeds
    cache.prompt_for(clip(0), 24000)
    assert m.embeds == calls  # kept
    cache.prompt_for(clip(1), 24000)
    assert m.embeds == calls + 1  # evicted, recomputed


def test_registered_voices_survive_eviction() -> None:
    m = Models(dim=256)
    cache = VoicePromptCache(m.embed, m.encode, max_bytes=1024)
    reg = cache.register("alice", clip(9), 24000, "alice speaking")
    for seed in range(5):
        cache.prompt_for(clip(seed), 24000)
    calls = m.embeds
    voice = cache.voice("alice")
    assert voice is reg and "alice" in cache and m.embeds == calls
    assert cache.unregister("alice") and cache.voice("alice") is None and not cache.unregister("alice")


def test_concurrent_requests_for_a_new_clip_compute_once() -> None:
    m = Models(delay=0.2)
    cache = VoicePromptCache(m.embed, m.encode)
    with ThreadPoolExecutor(8) as pool:
        prompts = list(pool.map(lambda _: cache.prompt_for(clip(5), 24000, "same text"), range(8)))
    assert (m.embeds, m.encodes) == (1, 1)
    assert all(torch.equal(p.speaker_embedding, prompts[0].speaker_embedding) for p in prompts)


def test_invalid_clips_raise_and_are_not_cached() -> None:
    m = Models()
    cache = VoicePromptCache(m.embed, m.encode)
    for _ in range(2):
        with pytest.raises(InvalidAudio, match="silent"):
            cache.prompt_for(np.zeros(48000, np.float32), 24000)
    assert m.embeds == 0 and cache.stats()["voice_cache_entries"] == 0


def test_waiters_see_the_owner_error() -> None:
    m = Models(delay=0.2)
    cache = VoicePromptCache(m.embed, None)  # no reference encoder: ICL impossible
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(cache.prompt_for, clip(6), 24000, "text") for _ in range(3)]
        errors = [f.exception() for f in futures]
    assert all(isinstance(e, RuntimeError) and "no reference encoder" in str(e) for e in errors)


def test_a_voice_from_a_real_speaker_encoder() -> None:
    cfg = dict(enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8)
    encoder = SpeakerEncoder(cfg).eval()
    m = Models()
    stereo_48k = np.stack([clip(3, rate=48000)] * 2, axis=1)
    voice = VoicePromptCache.for_models(encoder, m).prompt_for(stereo_48k, 48000, "reference words")
    assert voice.speaker_embedding.shape == (32,) and torch.isfinite(voice.speaker_embedding).all()
    assert (
        voice.ref_codes is not None
        and voice.ref_codes.shape == (25, 16)
        and voice.ref_text == "reference words"
    )
    xv = VoicePromptCache.for_models(encoder, m).prompt_for(stereo_48k, 48000, None)
    assert xv.ref_codes is None and torch.allclose(xv.speaker_embedding, voice.speaker_embedding)
