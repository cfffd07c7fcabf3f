from __future__ import annotations

import pytest

from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager, SlotPool, talker_kv_bytes_per_token


def test_talker_bytes_per_token_at_the_real_shapes():
    # 28 layers, 8 kv heads, head_dim 128, bf16: keys + values
    assert talker_kv_bytes_per_token(28, 8, 128, 2) == 114_688


def test_layout_from_budget_fits_whole_slots():
    lay = KVCacheLayout.from_budget(10_000, bytes_per_token=10, max_len=300)
    assert lay.num_slots == 3 and lay.bytes_per_stream == 3000 and lay.total_bytes == 9000
    assert KVCacheLayout.from_budget(10**9, 10, 300, max_slots=7).num_slots == 7


def test_layout_below_one_stream_raises():
    with pytest.raises(ValueError, match="below one stream"):
        KVCacheLayout.from_budget(100, bytes_per_token=10, max_len=300)


def test_slot_pool_hands_out_lowest_first_and_reuses():
    pool = SlotPool(3)
    assert [pool.allocate(x) for x in "abc"] == [0, 1, 2]
    assert pool.allocate("d") is None
    pool.free(1)
    pool.free(0)
    assert pool.allocate("e") == 0 and pool.owner(0) == "e"
    with pytest.raises(ValueError):
        pool.free(0) or pool.free(0)


def test_manager_tracks_lengths_and_reports():
    kv = KVCacheManager(KVCacheLayout(num_slots=2, max_len=100, bytes_per_token=8))
    s = kv.allocate("a")
    assert s is not None and kv.length(s) == 0 and kv.room(s) == 100
    kv.set_length(s, 40)
    stats = kv.stats()
    assert stats["kv_tokens_in_use"] == 40 and stats["kv_bytes_per_stream"] == 800
    assert stats["kv_utilisation"] == pytest.approx(0.2)
    with pytest.raises(ValueError):
        kv.set_length(s, 101)
    kv.free(s)
    assert kv.num_free == 2 and kv.tokens_in_use == 0
