"""The stage with a real (tiny, random) Qwen3 forced aligner on the CPU: over the fake tone engine in
English and Mandarin, and over the Qwen3-TTS engine on a tiny random model."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.alignment.engine import AlignedEngine
from engine.api import AudioChunk, SynthesisRequest, TextSegment
from tests.engine.alignment.tiny_aligner import tiny_aligner
from tests.engine.qwen3.utils import engine_config
from tests.fakes import FakeEngine

CASES = {
    "English": ("Sure, I can help ", "you with that. ", "Anything else?"),
    "Chinese": ("我可以帮你，", "今天天气很好。", "还有别的吗？"),
}


@pytest.fixture(scope="module")
def aligner(tmp_path_factory):
    return tiny_aligner(tmp_path_factory.mktemp("tiny_aligner"))


async def collect(stream) -> list[AudioChunk]:
    return [c async for c in stream]


def open_and_push(engine, rid: str, pieces, language: str, mode: str | None = None):
    stream = engine.open(SynthesisRequest(request_id=rid, language=language))
    if mode:
        stream.set_word_alignment(mode)
    at = 0
    for piece in pieces:
        stream.push(TextSegment(piece, at))
        at += len(piece)
    stream.close_text()
    return stream


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_tone_engine_english_and_mandarin_words_come_from_the_aligner(aligner, mode):
    engine = AlignedEngine(FakeEngine(chunk_ms=40), aligner)
    await engine.start()
    try:
        streams = {lang: open_and_push(engine, lang, pieces, lang, mode) for lang, pieces in CASES.items()}
        results = dict(
            zip(streams, await asyncio.gather(*(collect(s) for s in streams.values())), strict=True)
        )
        extra = engine.load().extra
    finally:
        await engine.stop()
    # where the real aligner's calls go, and what the admission's curve says a call costs
    assert (
        extra["aligner_prepare_ms"] > 0 and extra["aligner_wait_ms"] >= 0 and extra["aligner_finish_ms"] > 0
    )
    assert extra["aligner_call_ms_1"] > 0
    for lang, chunks in results.items():
        text = "".join(CASES[lang])
        words = [w for c in chunks for w in c.words]
        total = sum(len(c.samples) for c in chunks)
        assert chunks[-1].final and {w.source for w in words} == {"aligner"}
        assert all(text[w.char_start : w.char_end] == w.text for w in words)
        assert all(0 <= w.start_sample <= w.end_sample <= total for w in words)
        assert all(
            a.end_sample <= b.start_sample or a.start_sample <= b.start_sample
            for a, b in zip(words, words[1:], strict=False)
        )
        if lang == "Chinese":  # every ideograph is its own unit, punctuation joins the one before
            assert [w.text for w in words][:6] == ["我", "可", "以", "帮", "你，", "今"]
        else:
            assert [w.text for w in words] == text.split()
        if mode == "sync":
            sent = 0
            for c in chunks:
                sent += len(c.samples)
                assert all(w.end_sample <= sent for w in c.words)


# -- over the Qwen3-TTS engine (tiny random model, steps driven by hand) ----------------------------


@pytest.fixture(scope="module")
def tts_bundle(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from engine.qwen3.loader import load_qwen3_tts, read_tensors, weight_files
    from engine.qwen3.models.codec import Code2Wav
    from tests.reference_builders import build_reference_tts

    checkpoint = build_reference_tts("custom_voice", tmp_path_factory.mktemp("tiny_cv"))
    torch.manual_seed(0)
    b = load_qwen3_tts(checkpoint, "cpu", torch.float32)
    st = checkpoint / "speech_tokenizer"
    codec = Code2Wav(json.loads((st / "config.json").read_text())["decoder_config"])
    codec.load_state_dict(read_tensors(weight_files(st), "decoder."), strict=True)
    return b, codec.eval()


def qwen3_engine(bundle, **overrides):
    from engine.qwen3.engine import Qwen3Engine

    b, codec = bundle
    cfg = dict(max_streams=4, kv_slots=4, max_len=128, max_batch=4, enforce_eager=True, progress_bar=False)
    cfg.update(overrides)
    engine = Qwen3Engine(b.config, b.generation, b.tokenizer, b.talker, codec, engine_config(**cfg))
    engine._ready = True  # steps are driven by hand (no step thread)
    return engine


def step(engine) -> None:
    engine.core._emit(engine.core.step())


def qwen3_open(aligned, rid: str, pieces, frames: int, mode: str):
    stream = aligned.open(
        SynthesisRequest(request_id=rid, voice="ryan", language="English", greedy=True, max_frames=frames)
    )
    stream.set_word_alignment(mode)
    at = 0
    for piece in pieces:
        stream.push(TextSegment(piece, at))
        at += len(piece)
    stream.close_text()
    return stream


@pytest.mark.reference
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_qwen3_engine_estimates_are_replaced_by_aligned_words(tts_bundle, aligner, mode):
    inner = qwen3_engine(tts_bundle)
    aligned = AlignedEngine(inner, aligner)
    aligned.worker.start()
    try:
        pieces = ("Hello world. ", "Good morning to you.")
        stream = qwen3_open(aligned, "q", pieces, 4, mode)
        for _ in range(100):
            if not inner.core.has_work():
                break
            step(inner)
        chunks = await asyncio.wait_for(collect(stream), 10)
    finally:
        aligned.worker.stop()
    text = "".join(pieces)
    words = [w for c in chunks for w in c.words]
    total = sum(len(c.samples) for c in chunks)
    assert chunks[-1].final and total == 2 * 4 * 1920  # two segments of 4 frames each
    assert [w.text for w in words] == text.split() and {w.source for w in words} == {"aligner"}
    first_segment_end = 4 * 1920  # the first job's window is the first segment's frames
    assert all(w.end_sample <= first_segment_end for w in words[:2])
    assert all(w.start_sample >= first_segment_end for w in words[2:])


@pytest.mark.reference
async def test_cancel_through_the_stage_frees_the_slot_at_the_next_engine_step(tts_bundle, aligner):
    inner = qwen3_engine(tts_bundle, kv_slots=1, max_streams=2)
    aligned = AlignedEngine(inner, aligner)
    aligned.worker.start()
    try:
        stream_a = qwen3_open(aligned, "a", ("Hello world.",), 50, "sync")
        stream_b = qwen3_open(aligned, "b", ("Good morning",), 2, "sync")
        step(inner)
        step(inner)
        a, b = inner.scheduler.requests["a"], inner.scheduler.requests["b"]
        assert a.kv_slot == 0 and b.kv_slot is None
        before = aligned.load()
        stream_a.cancel()
        assert aligned.load().active == before.active and a.kv_slot == 0  # applied at the next step
        step(inner)
        assert a.kv_slot is None and a.codec_slot is None and b.kv_slot == 0  # the slot went to b at once
        assert aligned.load().active == before.active  # b took a's place: a is no longer counted
        assert "a" not in inner._streams
        for _ in range(50):
            if not inner.scheduler.has_work():
                break
            step(inner)
        assert await asyncio.wait_for(collect(stream_a), 5) == []
        chunks_b = await asyncio.wait_for(collect(stream_b), 10)
        assert chunks_b[-1].final and aligned.load().active == 0
    finally:
        aligned.worker.stop()
