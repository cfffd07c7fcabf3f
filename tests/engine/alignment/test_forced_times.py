"""Forced word times (the benchmark's aligner mode): the benchmark's speech rate, the same across
windows cut at a word, the wrapped aligner still run; and with them a random aligner's sync probes
confirm words, so first audio comes while the first segment is being made."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.alignment.api import AlignedWord
from engine.alignment.engine import AlignedEngine
from engine.alignment.forced_times import ForcedTimesAligner, forced_words, speech_offsets
from engine.api import SynthesisRequest, TextSegment
from tests.engine.alignment.fakes import HandFedEngine, SpreadAligner
from tests.engine.alignment.test_sync_probes import ENGINE_RATE, no_probe_in_flight, words_lead_audio
from tests.engine.alignment.tiny_aligner import tiny_aligner


def test_offsets_follow_the_benchmarks_rates():
    english = speech_offsets("abcdefghijklmn")
    assert english[0] == 0 and english[-1] == pytest.approx(1.0)  # 14 characters a second
    chinese = speech_offsets("我可以帮你，今天天气")
    assert chinese[5] == pytest.approx(5 / 4.5)
    assert chinese[6] == pytest.approx(5 / 4.5 + 1 / 14)  # the full-width comma at the alphabetic rate
    assert chinese[-1] == pytest.approx(9 / 4.5 + 1 / 14)


def test_units_take_the_rate_and_the_untold_ones_sit_at_the_audios_end():
    text = "Sure, I can help you with that today."
    units = [(t, text.index(t)) for t in ("Sure,", "I", "can", "help", "you", "today.")]
    words = [AlignedWord(t, 9.0, 9.5, at, at + len(t)) for t, at in units]  # the model's: noise
    got = forced_words(words, text, audio_s=1.2)
    assert [(w.text, w.char_start, w.char_end) for w in got] == [
        (w.text, w.char_start, w.char_end) for w in words
    ]
    # 14 characters a second; "you" starts past the audio, "today." too: at its end
    assert [(w.start_s, w.end_s) for w in got] == [
        (0.0, 0.357),
        (0.429, 0.5),
        (0.571, 0.786),
        (0.857, 1.143),
        (1.2, 1.2),
        (1.2, 1.2),
    ]
    # the same words in a longer window keep their times: what lets two probes agree
    longer = forced_words(words, text, audio_s=2.0)
    assert [(w.start_s, w.end_s) for w in longer[:4]] == [(w.start_s, w.end_s) for w in got[:4]]


def test_a_window_cut_after_a_word_times_the_rest_as_the_whole_text_did():
    """A probe after a cut sees the text from the last timed word's end and the audio from that
    word's end time: the next words keep the times they had in the window before the cut."""
    text = "Please arrive fifteen minutes early."
    spans = [(text.index(t), text.index(t) + len(t)) for t in text.split()]
    whole = forced_words([AlignedWord(text[a:b], 0, 0, a, b) for a, b in spans], text, audio_s=5.0)
    cut_char, cut_s = spans[0][1], whole[0].end_s  # "Please" timed: the rest starts at its end
    rest = text[cut_char:]
    rest_words = [AlignedWord(text[a:b], 0, 0, a - cut_char, b - cut_char) for a, b in spans[1:]]
    after = forced_words(rest_words, rest, audio_s=5.0 - cut_s)
    for before, later in zip(whole[1:], after, strict=True):
        assert later.start_s + cut_s == pytest.approx(before.start_s, abs=0.002)
        assert later.end_s + cut_s == pytest.approx(before.end_s, abs=0.002)


def test_the_wrapped_aligner_runs_and_lends_its_other_attributes():
    inner = SpreadAligner()
    forced = ForcedTimesAligner(inner)
    audio = np.zeros(16_000, np.float32)
    (words,) = forced.align([(audio, 16_000, "One two three.", "English")])
    assert inner.batches == [["One two three."]]  # the model's call happens as always
    assert [w.text for w in words] == ["One", "two", "three."]
    assert [(w.start_s, w.end_s) for w in words] == [(0.0, 0.214), (0.286, 0.5), (0.571, 1.0)]
    assert forced.max_audio_s == inner.max_audio_s and forced.batches is inner.batches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_aligner(tmp_path_factory.mktemp("tiny_aligner_forced"))


async def first_chunk_while_made(aligner) -> tuple[bool, dict[str, float]]:
    """Feed a segment's first 15 frames of audio in the Qwen3 engine's first chunk sizes: whether its
    first audio comes out before the rest of the segment exists, and the stage's figures."""
    inner = HandFedEngine(ENGINE_RATE)
    engine = AlignedEngine(inner, aligner, default_mode="sync")
    await engine.start()
    try:
        text = "Sure, I can help you with that today and tomorrow as well."
        stream = engine.open(SynthesisRequest(request_id="s", language="English"))
        stream.push(TextSegment(text, 0))
        stream.close_text()
        fed = inner.streams[0]
        audio = (np.sin(np.arange(int(len(text) / 14 * ENGINE_RATE)) / 9) / 4).astype(np.float32)
        frame = ENGINE_RATE * 80 // 1000
        for size in (1, 2, 4, 8):
            fed.feed(audio[fed.produced : fed.produced + size * frame])
            await no_probe_in_flight(stream)
        chunks = stream.__aiter__()
        first = asyncio.ensure_future(chunks.__anext__())
        await asyncio.wait({first}, timeout=1.0)
        early = first.done()
        fed.feed(audio[fed.produced :])
        fed.finish(())
        out = [await first] + [c async for c in chunks]
        assert out[-1].final and sum(len(c.samples) for c in out) == len(audio)
        words_lead_audio(out)
        if early:
            assert out[0].words and all(w.end_sample <= len(out[0].samples) for w in out[0].words)
        return early, engine.load().extra
    finally:
        await engine.stop()


async def test_forced_times_let_a_random_aligners_probes_release_audio_early(tiny):
    early, extra = await first_chunk_while_made(ForcedTimesAligner(tiny))
    assert early and extra["aligner_probe_words"] > 0
    assert extra["aligner_probes"] >= 2


async def test_a_random_aligners_own_times_hold_audio_for_the_segment(tiny):
    early, extra = await first_chunk_while_made(tiny)
    assert not early and extra["aligner_probe_words"] == 0 and extra["aligner_probes"] >= 2
