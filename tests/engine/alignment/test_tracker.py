"""AlignmentTracker, the stage's sans-I/O core: where jobs are cut, what is held, what goes out."""

from __future__ import annotations

import numpy as np
import pytest

from engine.alignment.api import AlignedWord
from engine.alignment.track import AlignJob, AlignmentTracker, content_end
from engine.api import PCM16_FULL_SCALE, AudioChunk, TextSegment, WordTiming

RATE = 1000  # samples per second, to keep the arithmetic readable


def tracker(mode: str = "async", segments: tuple[TextSegment, ...] = ()) -> AlignmentTracker:
    t = AlignmentTracker("r", "English", RATE, max_window_s=60.0, mode=mode)  # type: ignore[arg-type]
    for s in segments:
        t.push(s)
    return t


def engine_word(text: str, c0: int, s0: int, s1: int) -> WordTiming:
    return WordTiming(text, s0, s1, c0, c0 + len(text), source="estimate")


def chunk(offset: int, n: int, words: tuple[WordTiming, ...] = (), final: bool = False) -> AudioChunk:
    samples = (np.arange(offset, offset + n) % 97 / 100).astype(np.float32)
    return AudioChunk("r", samples, offset, words, final)


def final(offset: int) -> AudioChunk:
    return AudioChunk("r", np.zeros(0, np.float32), offset, (), final=True)


def answer(job: AlignJob, spans: list[tuple[int, int, float, float]]) -> tuple[WordTiming, ...]:
    return job.words_from([AlignedWord(job.text[a:b], s, e, a, b) for a, b, s, e in spans])


SEGMENTS = (TextSegment("Hello there. ", 0), TextSegment("How are you?", 13))
FIRST_WORDS = (engine_word("Hello", 0, 0, 400), engine_word("there.", 6, 450, 900))
SECOND_WORDS = (
    engine_word("How", 13, 1000, 1300),
    engine_word("are", 17, 1350, 1600),
    engine_word("you?", 21, 1650, 1900),
)


def test_content_end_skips_trailing_punctuation_and_space():
    assert content_end(TextSegment("Hello there. ", 0)) == 11
    assert content_end(TextSegment("好的，", 5)) == 7
    assert content_end(TextSegment(" ... ", 3)) is None


def test_async_passes_audio_at_once_and_sends_words_when_aligned():
    t = tracker("async", SEGMENTS)
    out, jobs = t.on_chunk(chunk(0, 1000, FIRST_WORDS))
    assert [(c.sample_offset, len(c.samples), c.words) for c in out] == [
        (0, 1000, ())
    ]  # engine words dropped
    assert len(jobs) == 1 and (jobs[0].window_start, jobs[0].window_end) == (0, 900)
    assert jobs[0].text == "Hello there. " and len(jobs[0].audio) == 900
    assert np.array_equal(jobs[0].audio, chunk(0, 900).samples)
    words = answer(jobs[0], [(0, 5, 0.1, 0.35), (6, 12, 0.4, 0.85)])
    out = t.on_aligned(jobs[0], words)
    assert len(out) == 1 and len(out[0].samples) == 0 and out[0].sample_offset == 1000
    assert [
        (w.text, w.start_sample, w.end_sample, w.char_start, w.char_end, w.source) for w in out[0].words
    ] == [("Hello", 100, 350, 0, 5, "aligner"), ("there.", 400, 850, 6, 12, "aligner")]
    out, jobs = t.on_chunk(
        chunk(1000, 1000, SECOND_WORDS)
    )  # its last word is in: no need to wait for the end
    assert [len(c.samples) for c in out] == [1000]
    assert len(jobs) == 1 and (jobs[0].window_start, jobs[0].window_end) == (900, 1900)
    assert jobs[0].text == "How are you?"
    out, more = t.on_chunk(final(2000))
    assert out == [] and more == [] and not t.finished  # the final chunk waits for the words
    out = t.on_aligned(jobs[0], answer(jobs[0], [(0, 3, 0.2, 0.4), (4, 7, 0.5, 0.7), (8, 12, 0.8, 2.0)]))
    assert [w.char_start for w in out[0].words] == [13, 17, 21]
    assert out[0].words[-1].end_sample == 1900  # clipped to the window
    assert out[-1].final and out[-1].sample_offset == 2000 and t.finished


def test_segment_done_when_its_last_word_arrives():
    t = tracker("async", SEGMENTS)
    _, jobs = t.on_chunk(chunk(0, 1000, FIRST_WORDS[:1]))
    assert jobs == []  # "there" not spoken yet
    _, jobs = t.on_chunk(chunk(1000, 10, FIRST_WORDS[1:]))
    assert len(jobs) == 1


def test_job_waits_for_the_audio_up_to_its_cut():
    t = tracker("async", SEGMENTS)
    _, jobs = t.on_chunk(chunk(0, 500, FIRST_WORDS))
    assert jobs == []  # words say 900, only 500 samples are in
    _, jobs = t.on_chunk(chunk(500, 500))
    assert [j.window_end for j in jobs] == [900]


def test_sync_holds_audio_until_its_words_are_known():
    t = tracker("sync", SEGMENTS)
    out, jobs = t.on_chunk(chunk(0, 1000, FIRST_WORDS))
    assert out == [] and jobs[0].urgent
    out = t.on_aligned(jobs[0], answer(jobs[0], [(0, 5, 0.0, 0.3), (6, 12, 0.4, 0.8)]))
    assert [(c.sample_offset, len(c.samples), len(c.words)) for c in out] == [(0, 900, 2)]
    assert all(w.end_sample <= 900 for w in out[0].words)  # words come with or before their audio
    out, jobs = t.on_chunk(chunk(1000, 1000, SECOND_WORDS))
    assert out == [] and jobs[0].window_end == 1900
    out, _ = t.on_chunk(final(2000))
    assert out == []
    out = t.on_aligned(jobs[0], answer(jobs[0], [(0, 3, 0.0, 0.1)]))
    assert [(c.sample_offset, len(c.samples), c.final) for c in out] == [
        (900, 1000, False),
        (1900, 100, False),
        (2000, 0, True),
    ]
    audio = np.concatenate([c.samples for c in out])
    assert np.array_equal(audio, chunk(900, 1100).samples)


def test_results_out_of_order_are_released_in_order():
    t = tracker("sync", SEGMENTS)
    _, first = t.on_chunk(chunk(0, 1000, FIRST_WORDS))
    _, second = t.on_chunk(chunk(1000, 1000, SECOND_WORDS, final=True))
    assert t.on_aligned(second[0], answer(second[0], [(0, 3, 0.0, 0.1)])) == []
    out = t.on_aligned(first[0], answer(first[0], [(0, 5, 0.0, 0.1)]))
    assert [c.sample_offset for c in out] == [0, 900, 2000] and out[-1].final
    assert [w.char_start for c in out for w in c.words] == [0, 13]


def test_engine_without_words_is_cut_at_the_next_timed_segment_or_the_end():
    segs = (TextSegment("One two. ", 0), TextSegment("Three four. ", 9), TextSegment("Five.", 21))
    t = tracker("async", segs)
    _, jobs = t.on_chunk(chunk(0, 1500))
    assert jobs == []
    _, jobs = t.on_chunk(chunk(1500, 600, (engine_word("Five.", 21, 1600, 2000),), final=True))
    assert [(j.text, j.window_start, j.window_end) for j in jobs] == [
        ("One two. Three four. ", 0, 1600),
        ("Five.", 1600, 2100),
    ]
    words = answer(jobs[0], [(0, 3, 0, 0.1), (4, 8, 0.2, 0.3), (9, 14, 0.4, 0.5), (15, 20, 0.6, 0.7)])
    assert [(w.text, w.char_start, w.char_end) for w in words] == [
        ("One", 0, 3),
        ("two.", 4, 8),
        ("Three", 9, 14),
        ("four.", 15, 20),
    ]


def test_pieces_without_a_space_between_are_joined_with_one_and_mapped_back():
    segs = (TextSegment("Well,", 0), TextSegment("yes", 5), TextSegment("好的", 8, char_map=(20, 22)))
    t = tracker("async", segs)
    _, jobs = t.on_chunk(chunk(0, 500, final=True))
    (job,) = jobs
    assert job.text == "Well, yes 好的"
    words = answer(job, [(0, 5, 0, 0.1), (6, 9, 0.1, 0.2), (10, 11, 0.2, 0.3), (11, 12, 0.3, 0.4)])
    assert [(w.text, w.char_start, w.char_end) for w in words] == [
        ("Well,", 0, 5),
        ("yes", 5, 8),
        ("好", 20, 21),
        ("的", 22, 23),
    ]


def test_short_windows_are_padded_for_the_aligner():
    t = tracker("async", (TextSegment("Hi", 0),))
    _, jobs = t.on_chunk(chunk(0, 30, (engine_word("Hi", 0, 0, 30),), final=True))
    assert len(jobs[0].audio) == 100 and jobs[0].window_end == 30
    words = answer(jobs[0], [(0, 2, 0.0, 0.09)])
    assert words[0].end_sample == 30  # never past the real audio


def test_off_mode_passes_the_engine_chunks_through():
    t = tracker("off", SEGMENTS)
    c = chunk(0, 1000, FIRST_WORDS)
    out, jobs = t.on_chunk(c)
    assert out == [c] and jobs == []


def test_mode_is_fixed_once_audio_flows():
    t = tracker("async", SEGMENTS)
    t.set_mode("sync")
    t.on_chunk(chunk(0, 10))
    t.set_mode("off")
    assert t.mode == "sync"
    with pytest.raises(ValueError):
        t.set_mode("later")  # type: ignore[arg-type]


def test_punctuation_only_segment_makes_no_job():
    segs = (TextSegment("Hi. ", 0), TextSegment("... ", 4), TextSegment("Bye.", 8))
    t = tracker("async", segs)
    _, jobs = t.on_chunk(chunk(0, 400, (engine_word("Hi.", 0, 0, 300),)))
    _, more = t.on_chunk(chunk(400, 400, (engine_word("Bye.", 8, 500, 700),), final=True))
    assert [j.text for j in jobs + more] == ["Hi. ", "Bye."]
    assert more[0].window_start == 300 and more[0].window_end == 800


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_int16_pcm_passes_on_as_it_came_and_the_aligner_reads_float(mode):
    """The engine workers hand int16 PCM: it leaves unconverted (one chunk's own array in async
    mode), while the job's window is float32 in [-1, 1]."""
    t = tracker(mode, SEGMENTS)
    pcm = (np.arange(1000) * 31 % 20_000 - 10_000).astype(np.int16)
    out, jobs = t.on_chunk(AudioChunk("r", pcm, 0, FIRST_WORDS))
    assert len(jobs) == 1 and jobs[0].audio.dtype == np.float32
    np.testing.assert_allclose(jobs[0].audio[:900], pcm[:900] / PCM16_FULL_SCALE, atol=1e-6)
    if mode == "async":
        assert len(out) == 1 and np.shares_memory(out[0].samples, pcm)  # not even copied
    else:
        assert not out
        out = t.on_aligned(jobs[0], answer(jobs[0], [(0, 5, 0.0, 0.4), (6, 12, 0.45, 0.9)]))
    later, _ = t.on_chunk(AudioChunk("r", pcm[:200].copy(), 1000, ()))
    released = np.concatenate([c.samples for c in out + later if len(c.samples)])
    assert released.dtype == np.int16
    np.testing.assert_array_equal(released, np.concatenate([pcm, pcm[:200]])[: len(released)])
