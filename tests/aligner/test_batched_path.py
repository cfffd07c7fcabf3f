"""The batched host path: steady encoder shapes, one-pass repair, batched prompts (CPU, tiny model)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from aligner.layout import chunk_bucket, encoder_output_length
from aligner.model import LogMel
from aligner.qwen3 import Qwen3ForcedAligner, model_audio, to_model_audio
from aligner.repair import repair_monotonic, repair_monotonic_rows
from tests.aligner.conftest import noise
from tests.engine.alignment.tiny_aligner import tiny_aligner


@pytest.fixture(scope="module")
def aligner(tmp_path_factory: pytest.TempPathFactory) -> Qwen3ForcedAligner:
    return tiny_aligner(Path(tmp_path_factory.mktemp("tiny_aligner")))


BATCH = [
    (noise(0.45, 16000, 1), 16000, "Short one.", "English"),
    (noise(2.6, 24000, 2), 24000, "A clip of a few words at a higher rate.", "English"),
    (
        noise(9.3, 16000, 3),
        16000,
        "Long enough for two attention windows of the encoder, then some.",
        "English",
    ),
    (noise(0.2, 16000, 4), 16000, "", "English"),
]


def test_steady_shapes_give_the_same_tokens_and_classes(aligner):
    tower = aligner.model.audio_tower
    waves = model_audio([(audio, rate) for audio, rate, _, _ in BATCH])
    features, frames = aligner.mel(waves)
    words = [aligner.splitter.words(text, language) for _, _, text, language in BATCH]
    with torch.inference_mode():
        exact, counts = tower.encode(features, frames)
        exact_times = aligner.slot_times_ms(waves, words)
        tower.steady_shapes = True
        try:
            steady, steady_counts = tower.encode(features, frames)
            steady_times = aligner.slot_times_ms(waves, words)
        finally:
            tower.steady_shapes = False
    assert counts == steady_counts == [encoder_output_length(n) for n in frames]
    torch.testing.assert_close(steady, exact, rtol=1e-5, atol=1e-5)
    assert steady_times == exact_times


def test_encoder_tokens_equal_one_item_at_a_time(aligner):
    waves = model_audio([(audio, rate) for audio, rate, _, _ in BATCH])
    features, frames = aligner.mel(waves)
    with torch.inference_mode():
        together = aligner.model.audio_tower(features, frames)
        for index, count in enumerate(frames):
            alone = aligner.model.audio_tower(features[index : index + 1, :, :count], [count])[0]
            torch.testing.assert_close(together[index], alone, rtol=1e-4, atol=1e-4)


def test_batched_prompts_equal_one_item_at_a_time(aligner):
    words = [aligner.splitter.words(text, language) for _, _, text, language in BATCH]
    rows = aligner.prompt_rows(words, [5, 0, 13, 2])
    assert rows == [
        aligner.prompt_ids(units, count) for units, count in zip(words, [5, 0, 13, 2], strict=True)
    ]
    assert rows[3].count(aligner.cfg.timestamp_token_id) == 2  # no units: one slot pair all the same


def test_resampling_on_threads_equals_one_by_one():
    items = [(noise(1.0 + i / 3, 24000, i), 24000) for i in range(5)] + [(noise(0.5, 16000, 9), 16000)]
    for threaded, alone in zip(model_audio(items), [to_model_audio(*item) for item in items], strict=True):
        np.testing.assert_array_equal(threaded, alone)


def _trusted_one_row(values: list[float]) -> list[bool]:
    """The longest non-decreasing subsequence (earliest-ending on ties), one row at a time."""
    best, parent = [1] * len(values), [-1] * len(values)
    for i in range(1, len(values)):
        candidates = [best[j] if values[j] <= values[i] else 0 for j in range(i)]
        j = candidates.index(max(candidates))
        if candidates[j] >= 1:
            best[i], parent[i] = candidates[j] + 1, j
    trusted = [False] * len(values)
    node = best.index(max(best)) if values else -1
    while node != -1:
        trusted[node], node = True, parent[node]
    return trusted


def test_repair_of_many_rows_equals_row_by_row():
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 30, int(rng.integers(0, 40))) * 80.0) for _ in range(200)]
    rows += [sorted(row) for row in rows[:20]]
    repaired = repair_monotonic_rows(rows)
    for row, fixed in zip(rows, repaired, strict=True):
        assert fixed == repair_monotonic(row)
        trusted = _trusted_one_row(row)
        assert [int(v) for v, keep in zip(row, trusted, strict=True) if keep] == [
            v for v, keep in zip(fixed, trusted, strict=True) if keep
        ]
        assert fixed == sorted(fixed)
    assert repair_monotonic_rows([]) == []


def test_chunk_buckets_are_few_and_cover_the_count():
    assert [chunk_bucket(n) for n in (1, 2, 3, 5, 200, 256, 257, 640)] == [1, 2, 4, 8, 256, 256, 512, 768]


def test_warm_up_runs_with_and_without_steady_shapes(aligner):
    tower = aligner.model.audio_tower
    aligner.warm_up(max_batch=4)
    tower.steady_shapes = True
    try:
        aligner.warm_up(max_batch=2, max_chunks=8)
    finally:
        tower.steady_shapes = False


def test_steady_log_mel_pads_to_whole_seconds_and_keeps_every_items_frames():
    waves = model_audio([(audio, rate) for audio, rate, _, _ in BATCH])
    exact, frames = LogMel()(waves)
    steady, steady_frames = LogMel(steady=True)(waves)
    assert steady_frames == frames
    assert steady.shape[-1] == 10 * 16000 // 160 > exact.shape[-1]  # 9.3 s padded on to 10 s
    longest = max(range(len(waves)), key=lambda i: len(waves[i]))
    for item, count in enumerate(frames):
        # the longest item's last frames saw reflected audio, now silence
        keep = count - 2 if item == longest else count
        torch.testing.assert_close(steady[item, :, :keep], exact[item, :, :keep], rtol=0, atol=1e-5)
