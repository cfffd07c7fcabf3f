"""The cache of Code2Wav states after a clone's reference clip: keyed by the codes tensor itself,
bounded by bytes, least recently used first out."""

from __future__ import annotations

import gc

import torch

from engine.qwen3.codec_state_cache import CodecStateCache


def state(n: int) -> list[torch.Tensor]:
    return [torch.full((n,), 1.0), torch.zeros(n // 2)]  # 6 n bytes


def test_a_stored_state_is_found_by_its_codes_tensor_only() -> None:
    cache = CodecStateCache(1 << 20)
    codes = torch.randint(0, 2048, (10, 16))
    same_values = codes.clone()
    kept = state(100)
    assert cache.store(codes, kept)
    assert cache.lookup(codes) is kept
    assert cache.lookup(same_values) is None  # another voice's tensor, even with equal codes
    assert (cache.hits, cache.misses) == (1, 1)


def test_a_dead_tensors_entry_never_matches_a_new_tensor() -> None:
    cache = CodecStateCache(1 << 20)
    codes = torch.zeros(5, 16, dtype=torch.long)
    cache.store(codes, state(10))
    del codes
    gc.collect()
    for _ in range(50):  # new tensors often land at a freed tensor's address (and id)
        assert cache.lookup(torch.zeros(5, 16, dtype=torch.long)) is None
    assert cache.hits == 0


def test_the_least_recently_used_state_goes_first_beyond_the_budget() -> None:
    cache = CodecStateCache(6 * 100 * 2)  # two states of 600 bytes
    a, b, c = (torch.zeros(3) for _ in range(3))
    cache.store(a, state(100))
    cache.store(b, state(100))
    assert cache.lookup(a) is not None  # a is now more recent than b
    cache.store(c, state(100))
    assert cache.lookup(b) is None and cache.lookup(a) is not None and cache.lookup(c) is not None
    assert cache.bytes == 1200 and cache.evictions == 1
    assert not cache.store(torch.zeros(1), state(1000))  # larger than the whole budget
    assert len(cache) == 2
