"""Tokenizer and prompt layouts against the reference package."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from engine.qwen3.models.config import parse_config
from engine.qwen3.prompt_builder import build_prompt
from engine.qwen3.prompts import PromptRequest, assistant_text, instruct_text, tokenize_request
from engine.qwen3.tokenizer import MISTRAL_FIX_PATTERN, TextTokenizer

pytestmark = pytest.mark.reference

TEXTS = [
    "Hello world.",
    "Good morning, how are you today? I am fine, thank you!",
    "numbers 1234 and 56; tabs\tand  double  spaces\n\nnew lines",
    "Ünïcödé café 中文 テスト",
]


class _Stop(Exception):
    pass


def reference_prompt(tts: Any, call: str, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The (left-padded) prefill embeddings and trailing text the reference hands to talker.generate."""
    seen: dict[str, torch.Tensor] = {}
    original = tts.model.talker.generate

    def spy(**kw: Any) -> Any:
        seen.update(
            embeds=kw["inputs_embeds"], mask=kw["attention_mask"], trailing=kw["trailing_text_hidden"]
        )
        raise _Stop

    tts.model.talker.generate = spy
    try:
        getattr(tts, call)(**kwargs)
    except _Stop:
        pass
    finally:
        tts.model.talker.generate = original
    return seen


def assert_prompts_equal(seen: dict[str, torch.Tensor], mine: list[Any]) -> None:
    for i, p in enumerate(mine):
        row = seen["embeds"][i][seen["mask"][i].bool()]
        assert row.shape == p.prefill.shape, f"row {i}: {tuple(row.shape)} vs {tuple(p.prefill.shape)}"
        torch.testing.assert_close(p.prefill, row, rtol=0, atol=1e-6)
        n = p.trailing.shape[0]
        torch.testing.assert_close(p.trailing, seen["trailing"][i][:n], rtol=0, atol=1e-6)
        assert torch.allclose(seen["trailing"][i][n:], p.tts_pad.expand(seen["trailing"].shape[1] - n, -1))


@pytest.mark.parametrize("text", TEXTS + [assistant_text("Hi there."), instruct_text("Be calm.")])
def test_tokenizer_matches_reference_processor(references: dict, bundles: dict, text: str) -> None:
    tts, ours = references["custom_voice"], bundles["custom_voice"].tokenizer
    ref_ids = tts.processor(text=text, return_tensors="pt")["input_ids"][0].tolist()
    # the reference loads with the regex quirk (see engine.qwen3.tokenizer); both splits agree on these texts
    quirk = TextTokenizer.from_dir(bundles["custom_voice"].path, MISTRAL_FIX_PATTERN)
    assert quirk.encode(text) == ref_ids
    assert ours.encode(text) == ref_ids
    assert ours.decode(ours.encode(text)) == text


def test_chatml_frame_token_counts(bundles: dict) -> None:
    tok = bundles["custom_voice"].tokenizer
    ids = tok.encode(assistant_text("Hello world."))
    assert (
        len(tok.encode("<|im_start|>assistant\n")) == 3
        and len(tok.encode("<|im_end|>\n<|im_start|>assistant\n")) == 5
    )
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-3] == tok.token_id("<|im_start|>")


@pytest.mark.parametrize("non_streaming", [True, False])
def test_custom_voice_prompts_match(references: dict, bundles: dict, non_streaming: bool) -> None:
    b = bundles["custom_voice"]
    rows = [
        dict(text="Hello world.", speaker="Ryan", language="English", instruct="Be calm."),
        dict(text="Good morning, how are you today?", speaker="Eric", language="Auto", instruct=""),
        dict(text="The quick brown fox.", speaker="Vivian", language="Chinese", instruct=""),
    ]
    seen = reference_prompt(
        references["custom_voice"],
        "generate_custom_voice",
        text=[r["text"] for r in rows],
        speaker=[r["speaker"] for r in rows],
        language=[r["language"] for r in rows],
        instruct=[r["instruct"] for r in rows],
        non_streaming_mode=non_streaming,
    )
    mine = [
        build_prompt(b.talker, b.config, b.tokenizer, PromptRequest(non_streaming=non_streaming, **r))
        for r in rows
    ]
    assert_prompts_equal(seen, mine)


@pytest.mark.parametrize("non_streaming", [True, False])
def test_icl_prompts_match(references: dict, bundles: dict, non_streaming: bool) -> None:
    """Reference text longer and shorter than the reference frames."""
    b, tts = bundles["base"], references["base"]
    wav = (0.2 * np.sin(np.arange(24000) * 0.05)).astype(np.float32)
    items = tts.create_voice_clone_prompt(
        ref_audio=[(wav, 24000), (wav[:6000], 24000)],
        ref_text=["Hi.", "Reference words for the cloned voice, spoken clearly and slowly."],
    )
    texts = ["Good morning, how are you today?", "Hello."]
    seen = reference_prompt(
        tts,
        "generate_voice_clone",
        text=texts,
        language=["English", "Auto"],
        voice_clone_prompt=items,
        non_streaming_mode=non_streaming,
    )
    mine = [
        build_prompt(
            b.talker,
            b.config,
            b.tokenizer,
            PromptRequest(
                text=t,
                language=lang,
                speaker_embedding=it.ref_spk_embedding,
                ref_codes=it.ref_code,
                ref_text=it.ref_text,
                non_streaming=non_streaming,
            ),
        )
        for t, lang, it in zip(texts, ["English", "Auto"], items, strict=True)
    ]
    assert_prompts_equal(seen, mine)


def test_language_and_speaker_resolution(bundles: dict) -> None:
    b = bundles["custom_voice"]
    cfg, tok = b.config, b.tokenizer
    ids = cfg.talker.language_ids

    def lang_id(**kw: Any) -> int | None:
        return tokenize_request(tok, cfg, PromptRequest(text="Hi.", **kw)).language_id

    assert lang_id(language="English", speaker="eric") == ids["english"]
    assert lang_id(language="Chinese", speaker="Eric") == ids["sichuan_dialect"]
    assert lang_id(language="Auto", speaker="dylan") == ids["beijing_dialect"]
    assert lang_id(language="Auto", speaker="ryan") is None
    with pytest.raises(ValueError, match="language"):
        lang_id(language="Klingon")
    with pytest.raises(ValueError, match="language"):
        lang_id(language="sichuan_dialect")  # dialects are chosen through the speaker only
    with pytest.raises(ValueError, match="speaker"):
        lang_id(speaker="nobody")


def test_small_model_drops_instruction(bundles: dict) -> None:
    b = bundles["custom_voice"]
    small = parse_config({**b.config.raw, "tts_model_size": "0b6"})
    req = PromptRequest(text="Hi.", speaker="ryan", instruct="Whisper.")
    assert tokenize_request(b.tokenizer, small, req).instruct_ids is None
    assert tokenize_request(b.tokenizer, b.config, req).instruct_ids is not None
    design = dataclasses.replace(small, tts_model_type="voice_design")
    assert tokenize_request(b.tokenizer, design, req).instruct_ids is not None


def test_streaming_text_layout(bundles: dict) -> None:
    """Streaming text: the prompt holds text token 0; trailing = remaining tokens + tts_eos."""
    b = bundles["custom_voice"]
    req = PromptRequest(text="Good morning, how are you today?", speaker="ryan", language="English")
    tokens = tokenize_request(b.tokenizer, b.config, req)
    streaming = build_prompt(b.talker, b.config, b.tokenizer, req)
    full = build_prompt(b.talker, b.config, b.tokenizer, dataclasses.replace(req, non_streaming=True))
    n_text = len(tokens.text_ids) - 8
    assert streaming.trailing.shape[0] == n_text  # text[1:] + tts_eos
    assert full.trailing.shape[0] == 1 and full.prefill.shape[0] == streaming.prefill.shape[0] + n_text + 1


def test_a_batch_of_mixed_prompts_equals_each_built_alone(bundles: dict) -> None:
    """One builder, one batch: streaming and non-streaming text, an instruction, a clone and preset
    speakers in several languages, each equal to its prompt built alone (text projected row by row),
    and the kept tag embeddings serve a second batch unchanged."""
    from engine.qwen3.prompt_builder import PromptBuilder, PromptItem, build_prompt_embeds

    cv, base = bundles["custom_voice"], bundles["base"]
    reqs = [
        PromptRequest(text="Hello world.", speaker="Ryan", language="English", instruct="Be calm."),
        PromptRequest(text="Good morning, how are you today?", speaker="Eric", language="Auto"),
        PromptRequest(text="The quick brown fox.", speaker="Vivian", language="Chinese", non_streaming=True),
        PromptRequest(text="Hello world.", speaker="Ryan", language="English"),
    ]
    items = [
        PromptItem(tokenize_request(cv.tokenizer, cv.config, r), non_streaming=r.non_streaming) for r in reqs
    ]
    builder = PromptBuilder(cv.talker, cv.config)
    for _ in range(2):
        for item, got in zip(items, builder.build(items), strict=True):
            alone = build_prompt_embeds(cv.talker, cv.config, item.tokens, non_streaming=item.non_streaming)
            for a, b in (
                (got.prefill, alone.prefill),
                (got.trailing, alone.trailing),
                (got.tts_pad, alone.tts_pad),
            ):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert len(builder._tags) == 3  # (English, Ryan) built once for rows 0 and 3

    g = base.config.talker.num_code_groups
    clone = PromptRequest(
        text="Good morning.",
        language="English",
        speaker_embedding=torch.randn(base.config.talker.hidden_size),
        ref_codes=torch.randint(0, 100, (5, g)),
        ref_text="Hi there, reference.",
    )
    tokens = tokenize_request(base.tokenizer, base.config, clone)
    item = PromptItem(tokens, speaker_embedding=clone.speaker_embedding, ref_codes=clone.ref_codes)
    plain = PromptItem(tokenize_request(base.tokenizer, base.config, PromptRequest(text="Plain text.")))
    got = PromptBuilder(base.talker, base.config).build([plain, item, plain])[1]
    alone = build_prompt_embeds(
        base.talker, base.config, tokens, speaker_embedding=clone.speaker_embedding, ref_codes=clone.ref_codes
    )
    torch.testing.assert_close(got.prefill, alone.prefill, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.trailing, alone.trailing, rtol=0, atol=1e-6)
