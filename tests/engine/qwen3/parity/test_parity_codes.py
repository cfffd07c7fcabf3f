"""Greedy codes of our engine == the reference package's, on tiny random checkpoints saved in the
upstream layout (CPU, fp32): every prompt mode, batch 1 and mixed batches, both text modes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from engine.qwen3.generate import GenerationRequest, generate_codes
from engine.qwen3.loader import Qwen3TTSBundle, load_qwen3_tts
from engine.qwen3.prompt_builder import build_prompt
from engine.qwen3.prompts import PromptRequest
from tests.reference_builders import load_reference

pytestmark = pytest.mark.reference

FRAMES = 6  # reference max_new_tokens = FRAMES + 1
GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)


@contextlib.contextmanager
def captured_codes(tts: Any) -> Iterator[list[list[torch.Tensor]]]:
    """Record the codes the reference `model.generate` returns inside the wrapper calls."""
    calls: list[list[torch.Tensor]] = []
    original = tts.model.generate

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        codes, hidden = original(*args, **kwargs)
        calls.append([c.clone() for c in codes])
        return codes, hidden

    tts.model.generate = wrapper
    try:
        yield calls
    finally:
        tts.model.generate = original


def ours(bundle: Qwen3TTSBundle, requests: list[PromptRequest], frames: int = FRAMES) -> list[torch.Tensor]:
    prompts = [build_prompt(bundle.talker, bundle.config, bundle.tokenizer, r) for r in requests]
    gen = [GenerationRequest(prompt=p, greedy=True, max_frames=frames, seed=i) for i, p in enumerate(prompts)]
    return generate_codes(bundle.talker, gen, bundle.generation)


def assert_same(ref: list[torch.Tensor], mine: list[torch.Tensor]) -> None:
    assert len(ref) == len(mine)
    for i, (a, b) in enumerate(zip(ref, mine, strict=True)):
        assert a.shape == b.shape, f"row {i}: reference {tuple(a.shape)} vs ours {tuple(b.shape)}"
        assert torch.equal(a.cpu(), b.cpu()), f"row {i} differs:\n{a[:, :4].T}\n{b[:, :4].T}"


CUSTOM_ROWS = [
    dict(text="Hello world.", speaker="Ryan", language="English", instruct=""),
    dict(
        text="Good morning, how are you today? I am fine.",
        speaker="Eric",
        language="Chinese",
        instruct="Speak slowly, with a calm and deep voice.",
    ),
    dict(text="The quick brown fox.", speaker="Dylan", language="Auto", instruct=""),
]


@pytest.mark.parametrize("non_streaming", [True, False])
def test_custom_voice_batch1(references: dict, bundles: dict, non_streaming: bool) -> None:
    row = CUSTOM_ROWS[0]
    with captured_codes(references["custom_voice"]) as calls:
        references["custom_voice"].generate_custom_voice(non_streaming_mode=non_streaming, **row, **GREEDY)
    mine = ours(bundles["custom_voice"], [PromptRequest(non_streaming=non_streaming, **row)])
    assert_same(calls[0], mine)
    assert mine[0].shape == (FRAMES, 16)


@pytest.mark.parametrize("non_streaming", [True, False])
def test_custom_voice_mixed_batch(references: dict, bundles: dict, non_streaming: bool) -> None:
    """Different speakers (incl. dialect speakers), languages (incl. Auto), instructions and lengths."""
    rows = CUSTOM_ROWS
    with captured_codes(references["custom_voice"]) as calls:
        references["custom_voice"].generate_custom_voice(
            text=[r["text"] for r in rows],
            speaker=[r["speaker"] for r in rows],
            language=[r["language"] for r in rows],
            instruct=[r["instruct"] for r in rows],
            non_streaming_mode=non_streaming,
            **GREEDY,
        )
    mine = ours(bundles["custom_voice"], [PromptRequest(non_streaming=non_streaming, **r) for r in rows])
    assert_same(calls[0], mine)


@pytest.mark.parametrize("non_streaming", [True, False])
def test_voice_design(references: dict, bundles: dict, non_streaming: bool) -> None:
    texts = ["Hello world.", "This is a test of the speech engine."]
    instructs = ["A bright cheerful young woman.", "Speak slowly, with a calm and deep voice."]
    langs = ["English", "Auto"]
    with captured_codes(references["voice_design"]) as calls:
        references["voice_design"].generate_voice_design(
            text=texts, instruct=instructs, language=langs, non_streaming_mode=non_streaming, **GREEDY
        )
    mine = ours(
        bundles["voice_design"],
        [
            PromptRequest(text=t, instruct=i, language=lang, non_streaming=non_streaming)
            for t, i, lang in zip(texts, instructs, langs, strict=True)
        ],
    )
    assert_same(calls[0], mine)


def _ref_audio(seconds: float, freq: float) -> np.ndarray:
    t = np.arange(int(24000 * seconds)) / 24000
    return (0.3 * np.sin(2 * np.pi * freq * t) * np.exp(-t)).astype(np.float32)


@pytest.mark.parametrize("non_streaming", [False, True])
def test_voice_clone(references: dict, bundles: dict, non_streaming: bool) -> None:
    """ICL clones (reference text shorter and longer than the reference audio) and an x-vector-only
    clone in one batch. Speaker embeddings and reference codes come from the reference model."""
    tts = references["base"]
    items = tts.create_voice_clone_prompt(
        ref_audio=[
            (_ref_audio(0.5, 220.0), 24000),
            (_ref_audio(1.2, 330.0), 24000),
            (_ref_audio(0.8, 180.0), 24000),
        ],
        ref_text=["Reference words for the cloned voice, spoken clearly and slowly today.", "Hello.", None],
        x_vector_only_mode=[False, False, True],
    )
    texts = ["Good morning, how are you?", "The quick brown fox jumps over the lazy dog.", "Hello world."]
    langs = ["English", "Chinese", "Auto"]
    with captured_codes(tts) as calls:
        tts.generate_voice_clone(
            text=texts, language=langs, voice_clone_prompt=items, non_streaming_mode=non_streaming, **GREEDY
        )
    requests = [
        PromptRequest(
            text=t,
            language=lang,
            speaker_embedding=it.ref_spk_embedding,
            ref_codes=it.ref_code,
            ref_text=it.ref_text if it.icl_mode else None,
            non_streaming=non_streaming,
        )
        for t, lang, it in zip(texts, langs, items, strict=True)
    ]
    mine = ours(bundles["base"], requests)
    assert_same(calls[0], mine)
    # batch 1 equals the same row inside the batch
    assert_same([calls[0][1]], ours(bundles["base"], [requests[1]]))


def test_eos_trimming_matches(checkpoints: dict) -> None:
    """Make EOS win where code c would: rows end early (different lengths), trimmed like upstream."""
    tts = load_reference(checkpoints["custom_voice"])
    bundle = load_qwen3_tts(checkpoints["custom_voice"])
    rows = CUSTOM_ROWS
    kwargs = dict(
        text=[r["text"] for r in rows],
        speaker=[r["speaker"] for r in rows],
        language=[r["language"] for r in rows],
        instruct=[r["instruct"] for r in rows],
        non_streaming_mode=False,
        do_sample=False,
        subtalker_dosample=False,
        max_new_tokens=10,
    )
    with captured_codes(tts) as first:
        tts.generate_custom_voice(**kwargs)
    code = int(first[0][0][3, 0])  # row 0 picks this at frame 3
    with torch.no_grad():
        for head in (tts.model.talker.codec_head.weight, bundle.talker.codec_head.weight):
            head[2150] = head[code] * 1.5
    with captured_codes(tts) as calls:
        tts.generate_custom_voice(**kwargs)
    mine = ours(bundle, [PromptRequest(**r) for r in rows], frames=9)
    assert_same(calls[0], mine)
    assert mine[0].shape[0] <= 3 and any(m.shape[0] != mine[0].shape[0] for m in mine)
