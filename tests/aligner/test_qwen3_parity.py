"""Our Qwen3-ForcedAligner against the reference package on a tiny random checkpoint (CPU, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aligner.layout import encoder_output_length
from aligner.qwen3 import to_model_audio
from tests.aligner.conftest import noise

pytestmark = pytest.mark.reference

EN = "Hello world, this is a test of the aligner. Don't stop-me now 2024!"
ZH = "甚至出现交易几乎停滞的情况。今天用iPhone拍照"
JA = "今日はいい天気ですね。東京都に住んでいます。「すごい」と言った…"


def reference_items(reference, batch):
    audio = [(wave, rate) for wave, rate, _, _ in batch]
    results = reference.align(
        audio=audio, text=[text for *_, text, _ in batch], language=[lang for *_, lang in batch]
    )
    return [[(item.text, item.start_time, item.end_time) for item in result] for result in results]


def our_items(ours, batch):
    words = [ours.splitter.words(text, lang) for _, _, text, lang in batch]
    results = ours.align(batch)
    return [
        [(unit, word.start_s, word.end_s) for unit, word in zip(units, result, strict=True)]
        for units, result in zip(words, results, strict=True)
    ]


def reference_slot_classes(reference, batch) -> list[int]:
    prompts = [reference.aligner_processor.encode_timestamp(text, lang)[1] for _, _, text, lang in batch]
    waves = [to_model_audio(wave, rate) for wave, rate, _, _ in batch]
    inputs = reference.processor(text=prompts, audio=waves, return_tensors="pt", padding=True)
    with torch.inference_mode():
        logits = reference.model.thinker(**inputs).logits
    return logits.argmax(-1)[inputs["input_ids"] == reference.timestamp_token_id].tolist()


def our_slot_classes(ours, batch) -> list[int]:
    waves = [to_model_audio(wave, rate) for wave, rate, _, _ in batch]
    return ours.slot_classes(waves, [ours.splitter.words(text, lang) for _, _, text, lang in batch])


def test_features_and_prompt_ids_equal_the_reference(reference, ours):
    batch = [
        (noise(3.0, 16000, 1)[:-37], 16000, EN, "English"),
        (noise(2.2, 24000, 2), 24000, ZH, "Chinese"),
        (noise(0.4, 16000, 3), 16000, JA, "Japanese"),
    ]
    prompts = [reference.aligner_processor.encode_timestamp(text, lang)[1] for _, _, text, lang in batch]
    waves = [to_model_audio(wave, rate) for wave, rate, _, _ in batch]
    inputs = reference.processor(text=prompts, audio=waves, return_tensors="pt", padding=True)
    features, frames = ours.mel(waves)
    assert frames == inputs["feature_attention_mask"].sum(-1).tolist()
    torch.testing.assert_close(features, inputs["input_features"], rtol=0, atol=1e-5)
    for (_, _, text, lang), count, ids, mask in zip(
        batch, frames, inputs["input_ids"], inputs["attention_mask"], strict=True
    ):
        expected = ids[mask.bool()].tolist()
        assert ours.prompt_ids(ours.splitter.words(text, lang), encoder_output_length(count)) == expected


@pytest.mark.parametrize(
    ("text", "language", "seconds"),
    [(EN, "English", 3.0), (ZH, "Chinese", 4.5), (JA, "Japanese", 2.5)],
)
def test_single_input_times_equal_the_reference(reference, ours, text, language, seconds):
    batch = [(noise(seconds, 24000, 7), 24000, text, language)]
    assert our_slot_classes(ours, batch) == reference_slot_classes(reference, batch)
    assert our_items(ours, batch) == reference_items(reference, batch)


def test_batched_times_equal_the_reference(reference, ours):
    batch = [
        (noise(3.3, 16000, 11), 16000, EN, "English"),
        (noise(5.0, 24000, 12), 24000, ZH, "Chinese"),
        (noise(0.7, 16000, 13), 16000, JA, "Japanese"),
        (noise(1.5, 16000, 14), 16000, "", "English"),
    ]
    classes = our_slot_classes(ours, batch)
    assert len(set(classes)) > 3, "the tiny model should give varied slot classes"
    assert classes == reference_slot_classes(reference, batch)
    assert our_items(ours, batch) == reference_items(reference, batch)


def test_whole_clip_attention_equals_the_reference_sdpa_path(reference, ours):
    """Past 8 s the reference's CPU path attends over the whole clip; so does windowed=False."""
    batch = [(noise(12.3, 16000, 21), 16000, EN, "English"), (noise(9.0, 16000, 22), 16000, ZH, "Chinese")]
    ours.model.audio_tower.windowed = False
    try:
        assert our_slot_classes(ours, batch) == reference_slot_classes(reference, batch)
        assert our_items(ours, batch) == reference_items(reference, batch)
    finally:
        ours.model.audio_tower.windowed = True


def test_windowed_attention_equals_the_reference_with_window_masks(reference, ours, monkeypatch):
    """The reference honours its 8 s windows only under FlashAttention-2; on the CPU we give its
    layers the block-diagonal mask its own helper builds from the same window boundaries."""
    tower = reference.model.thinker.audio_tower
    for layer in tower.layers:
        plain = layer.forward

        def windowed(hidden_states, cu_seqlens, attention_mask=None, _plain=plain, **kwargs):
            mask = tower._prepare_attention_mask(hidden_states, cu_seqlens)
            return _plain(hidden_states, cu_seqlens, attention_mask=mask, **kwargs)

        monkeypatch.setattr(layer, "forward", windowed)
    batch = [(noise(17.5, 16000, 31), 16000, EN, "English"), (noise(3.0, 16000, 32), 16000, ZH, "Chinese")]
    waves = [to_model_audio(wave, rate) for wave, rate, _, _ in batch]
    features, frames = ours.mel(waves)
    with torch.inference_mode():
        expected = tower(features[0, :, : frames[0]], feature_lens=torch.tensor(frames[:1])).last_hidden_state
        got = ours.model.audio_tower(features, frames)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert our_slot_classes(ours, batch) == reference_slot_classes(reference, batch)
    assert our_items(ours, batch) == reference_items(reference, batch)


def test_aligned_words_point_into_the_client_text(ours):
    text = "Sure, I can help (you) with that."
    [words] = ours.align([(noise(2.0, 24000, 41), 24000, text, "English")])
    assert [w.text for w in words] == ["Sure,", "I", "can", "help", "(you)", "with", "that."]
    for word in words:
        assert text[word.char_start : word.char_end] == word.text
        assert 0 <= word.start_s <= word.end_s
        assert word.start_s * 1000 == pytest.approx(round(word.start_s * 1000))  # whole milliseconds
    starts = [w.start_s for w in words]
    assert starts == sorted(starts)


def test_reference_splitting_matches_ours(reference, ours):
    for text, language in [
        (EN, "English"),
        (ZH, "Chinese"),
        (JA, "Japanese"),
        ("naïve café-au-lait", "French"),
    ]:
        assert (
            ours.splitter.words(text, language)
            == reference.aligner_processor.encode_timestamp(text, language)[0]
        )
    assert np.all(np.isfinite(to_model_audio(noise(0.1, 16000, 1) * 50, 16000)))
