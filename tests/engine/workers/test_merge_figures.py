"""The worker pool reports its workers' engine figures as one engine's (for /metrics)."""

from __future__ import annotations

from engine.workers import merge_worker_figures


def test_times_and_sizes_are_averaged_counts_and_bytes_summed():
    a = {
        "step_ms_decode": 10.0,
        "batch_decode": 200.0,
        "gpu_memory_peak_bytes": 4e10,
        "kv_slots_used": 100.0,
        "ttfa_p50_ms": 40.0,
        "prefix_cache_hits": 3.0,
    }
    b = {
        "step_ms_decode": 14.0,
        "batch_decode": 100.0,
        "gpu_memory_peak_bytes": 3e10,
        "kv_slots_used": 50.0,
        "ttfa_p50_ms": 60.0,
    }
    merged = merge_worker_figures([a, b])
    assert (
        merged["step_ms_decode"] == 12.0 and merged["batch_decode"] == 150.0 and merged["ttfa_p50_ms"] == 50.0
    )
    assert merged["gpu_memory_peak_bytes"] == 7e10 and merged["kv_slots_used"] == 150.0
    assert merged["prefix_cache_hits"] == 3.0  # reported by one worker only


def test_latency_percentiles_and_shares_are_averaged_not_summed():
    a = {"aligner_sync_added_ttfa_ms_p50": 300.0, "lead_chunk_p10_ms": 100.0, "ttfa_p90_ms": 80.0}
    b = {"aligner_sync_added_ttfa_ms_p50": 500.0, "lead_chunk_p10_ms": 300.0, "ttfa_p90_ms": 120.0}
    b |= {"aligner_share": 0.5, "ttfa_samples": 10.0}
    a |= {"aligner_share": 0.3, "ttfa_samples": 30.0}
    merged = merge_worker_figures([a, b])
    assert merged["aligner_sync_added_ttfa_ms_p50"] == 400.0 and merged["lead_chunk_p10_ms"] == 200.0
    assert merged["ttfa_p90_ms"] == 100.0 and merged["aligner_share"] == 0.4
    assert merged["ttfa_samples"] == 40.0  # a count


def test_one_worker_passes_its_figures_through():
    only = {"step_ms_codec": 39.4, "kv_bytes_total": 3.7e10}
    assert merge_worker_figures([only]) == only
    assert merge_worker_figures([]) == {}


def test_the_qwen3_engine_on_a_gpu_gets_its_own_worker_process_unless_told_otherwise():
    from cadence.engines import EngineOptions, default_gpus

    qwen3 = EngineOptions(name="qwen3", model="m")
    assert default_gpus(qwen3, cuda_available=True) == "1"
    assert default_gpus(qwen3, cuda_available=False) is None  # CPU: in-process
    assert default_gpus(EngineOptions(name="qwen3", device="cuda"), cuda_available=True) == "1"
    assert default_gpus(EngineOptions(name="qwen3", device="cuda:1"), cuda_available=True) is None
    assert default_gpus(EngineOptions(name="qwen3", gpus="0"), cuda_available=True) is None
    assert default_gpus(EngineOptions(name="qwen3", gpus="all"), cuda_available=True) == "all"
    assert default_gpus(EngineOptions(name="espeak"), cuda_available=True) is None
