"""Sync mode's probes: audio of a segment still being made goes out word by word, each word before
the audio it describes; async mode never probes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.alignment.api import AlignedWord
from engine.alignment.engine import AlignedEngine
from engine.alignment.track import AlignJob, AlignmentTracker
from engine.api import AudioChunk, SynthesisRequest, TextSegment, WordTiming
from tests.engine.alignment.fakes import HandFedEngine, LateWordsEngine, SpreadAligner, ToneAligner
from tests.engine.alignment.tiny_aligner import tiny_aligner
from tests.fakes import FakeEngine

RATE = 1000  # samples per second: probes start at 500 samples, guard 240, agreement within 40
TEXT = "One two three four five."
TRUTH = {"One": (0, 250), "two": (300, 550), "three": (650, 950), "four": (1000, 1300), "five.": (1350, 1700)}


def chunk(offset: int, n: int, words: tuple[WordTiming, ...] = (), final: bool = False) -> AudioChunk:
    samples = (np.arange(offset, offset + n) % 97 / 100).astype(np.float32)
    return AudioChunk("r", samples, offset, words, final)


def estimates() -> tuple[WordTiming, ...]:
    """The engine's own words, known only once the segment is complete."""
    at = 0
    words = []
    for text, (s0, s1) in TRUTH.items():
        at = TEXT.index(text, at)
        words.append(WordTiming(text, s0, s1, at, at + len(text), "estimate"))
    return tuple(words)


def truthful(job: AlignJob) -> tuple[WordTiming, ...]:
    """A trained aligner on this audio: true times for what the window holds, the rest at its end."""
    aligned = []
    for text, (s0, s1) in TRUTH.items():
        at = job.text.find(text)
        if at < 0:
            continue
        start, end = min(s0, job.window_end), min(s1, job.window_end)
        rel = job.window_start
        aligned.append(AlignedWord(text, (start - rel) / RATE, (end - rel) / RATE, at, at + len(text)))
    return job.words_from(aligned)


def spread(job: AlignJob) -> tuple[WordTiming, ...]:
    """An aligner that spreads the text over whatever audio it gets (times move as audio grows)."""
    units = job.text.split()
    share = job.audio_s / len(units)
    aligned, at = [], 0
    for i, unit in enumerate(units):
        at = job.text.index(unit, at)
        aligned.append(AlignedWord(unit, i * share, (i + 0.9) * share, at, at + len(unit)))
        at += len(unit)
    return job.words_from(aligned)


def feed(tracker: AlignmentTracker, upto: int, step: int = 200) -> tuple[list[AudioChunk], list[AlignJob]]:
    out: list[AudioChunk] = []
    jobs: list[AlignJob] = []
    at = tracker._audio.end
    while at < upto:
        o, j = tracker.on_chunk(chunk(at, min(step, upto - at)))
        out += o
        jobs += j
        at += min(step, upto - at)
    return out, jobs


def sync_tracker() -> AlignmentTracker:
    t = AlignmentTracker("r", "English", RATE, max_window_s=60.0, mode="sync")
    t.push(TextSegment(TEXT, 0))
    return t


def test_words_that_two_probes_agree_on_go_out_before_the_segment_is_complete():
    t = sync_tracker()
    out, jobs = feed(t, 400)
    assert out == [] and jobs == []  # too little audio to probe
    out, jobs = feed(t, 600)
    (first,) = jobs
    assert first.probe and first.urgent and (first.window_start, first.window_end) == (0, 600)
    assert first.text == TEXT
    assert t.on_aligned(first, truthful(first)) == []  # nothing to compare with yet
    _, jobs = feed(t, 800)
    assert jobs == []  # not enough new audio since the last probe
    _, (second,) = feed(t, 1000)
    (released,) = t.on_aligned(second, truthful(second))
    # "three" ends too near the probe's end; "One" and "two" kept their times
    assert [w.text for w in released.words] == ["One", "two"]
    assert {w.source for w in released.words} == {"aligner"}
    assert (released.sample_offset, len(released.samples)) == (0, 550)
    assert np.array_equal(released.samples, chunk(0, 550).samples)
    _, (third,) = feed(t, 1400)
    assert (third.window_start, third.text) == (550, " three four five.")
    (released,) = t.on_aligned(third, truthful(third))
    assert [(w.text, w.char_start, w.start_sample, w.end_sample) for w in released.words] == [
        ("three", 8, 650, 950)
    ]
    assert (released.sample_offset, len(released.samples)) == (550, 400)
    # the segment completes: its job holds the rest of the text and the audio from the last cut
    _, (job,) = t.on_chunk(chunk(1400, 400, estimates()))
    assert not job.probe and (job.window_start, job.window_end, job.text) == (950, 1700, " four five.")
    assert [w.text for w in job.fallback] == ["four", "five."]
    out, _ = t.on_chunk(AudioChunk("r", np.zeros(0, np.float32), 1800, final=True))
    assert out == []
    out = t.on_aligned(job, truthful(job))
    assert [(c.sample_offset, len(c.samples), [w.text for w in c.words], c.final) for c in out] == [
        (950, 750, ["four", "five."], False),
        (1700, 100, [], False),
        (1800, 0, [], True),
    ]


def test_words_that_move_as_audio_grows_are_not_sent_early():
    t = sync_tracker()
    for upto in (600, 1000, 1600):  # each probe waits for half as much new audio as the last saw
        _, jobs = feed(t, upto)
        (probe,) = jobs
        assert t.on_aligned(probe, spread(probe)) == []
    _, (job,) = t.on_chunk(chunk(1600, 200, estimates()))
    assert (job.window_start, job.text) == (0, TEXT)


def test_a_probe_answered_after_its_segment_was_cut_is_dropped():
    t = sync_tracker()
    _, (probe,) = feed(t, 600)
    _, (job,) = t.on_chunk(chunk(600, 1200, estimates()))
    assert probe.cancelled and (job.window_start, job.text) == (0, TEXT)
    assert t.on_aligned(probe, truthful(probe)) == []
    (released,) = t.on_aligned(job, truthful(job))
    assert [w.text for w in released.words] == TEXT.split()


def test_no_probe_while_a_job_is_pending_or_in_async_mode():
    segments = (TextSegment("Hi there. ", 0), TextSegment(TEXT, 10))
    first_words = (WordTiming("Hi", 0, 100, 0, 2), WordTiming("there.", 150, 300, 3, 9))
    t = AlignmentTracker("r", "English", RATE, max_window_s=60.0, mode="sync")
    for s in segments:
        t.push(s)
    _, (job,) = t.on_chunk(chunk(0, 300, first_words))
    _, jobs = feed(t, 1500)
    assert jobs == []  # segment 1's words are not out yet
    t.on_aligned(job, job.fallback)
    _, (probe,) = feed(t, 1600)
    assert probe.probe and probe.window_start == 300
    asynced = AlignmentTracker("r", "English", RATE, max_window_s=60.0, mode="async")
    asynced.push(TextSegment(TEXT, 0))
    out, jobs = feed(asynced, 1600)
    assert jobs == [] and sum(len(c.samples) for c in out) == 1600


# -- the stage, over engines -----------------------------------------------------------------------
ENGINE_RATE = 24_000
WORDS = "Sure, I can help you with that today and tomorrow as well.".split()


def words_lead_audio(chunks: list[AudioChunk]) -> None:
    """Every word is out no later than the chunk that holds its first sample."""
    words = [w for c in chunks for w in c.words]
    announced: set[int] = set()
    sent = 0
    for c in chunks:
        announced |= {id(w) for w in c.words}
        sent += len(c.samples)
        assert all(id(w) in announced for w in words if w.start_sample < sent)


async def no_probe_in_flight(stream) -> None:
    for _ in range(1000):  # the stream's pump takes the chunk, the aligner thread answers its probe
        await asyncio.sleep(0.005)
        if stream._tracker._probe is None and stream._tracker._audio.end == stream.inner.produced:
            return
    raise AssertionError("the probe was never answered")


async def test_sync_first_audio_comes_while_the_first_segment_is_being_made():
    tones = FakeEngine()
    inner = HandFedEngine(ENGINE_RATE)
    aligner = ToneAligner()
    engine = AlignedEngine(inner, aligner, default_mode="sync")
    await engine.start()
    try:
        text = " ".join(WORDS)
        stream = engine.open(SynthesisRequest(request_id="s", language="English"))
        stream.push(TextSegment(text, 0))
        stream.close_text()
        fed = inner.streams[0]
        audio = np.concatenate(
            [np.concatenate((tones.tone(w), np.zeros(ENGINE_RATE // 25, np.float32))) for w in WORDS]
        )
        frame = ENGINE_RATE * 80 // 1000
        for size in (1, 2, 4, 8):  # the Qwen3 engine's first chunks, in 80 ms frames
            fed.feed(audio[fed.produced : fed.produced + size * frame])
            await no_probe_in_flight(stream)
        assert fed.produced < len(audio) // 2
        chunks = stream.__aiter__()
        first = await asyncio.wait_for(chunks.__anext__(), 10)  # only part of the segment exists
        assert len(first.samples) and first.words and first.sample_offset == 0
        assert [w.text for w in first.words] == WORDS[: len(first.words)]
        assert all(w.end_sample <= len(first.samples) for w in first.words)
        fed.feed(audio[fed.produced :])
        at, estimated, share = 0, [], len(audio) // len(WORDS)
        for i, w in enumerate(WORDS):  # the engine's estimates, with the segment's end
            at = text.index(w, at)
            estimated.append(WordTiming(w, i * share, (i + 1) * share, at, at + len(w), "estimate"))
        fed.finish(tuple(estimated))
        rest = [c async for c in chunks]
    finally:
        await engine.stop()
    out = [first, *rest]
    assert out[-1].final
    assert np.array_equal(np.concatenate([c.samples for c in out]), audio)
    assert [w.text for c in out for w in c.words] == WORDS
    assert {w.source for c in out for w in c.words} == {"aligner"}
    words_lead_audio(out)
    assert engine.load().extra["aligner_probes"] >= 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_aligner(tmp_path_factory.mktemp("tiny_aligner"))


async def speak(engine, rid: str, mode: str, texts: tuple[str, ...]) -> list[AudioChunk]:
    stream = engine.open(SynthesisRequest(request_id=rid, language="English"))
    stream.set_word_alignment(mode)
    at = 0
    for text in texts:
        stream.push(TextSegment(text, at))
        at += len(text)
    stream.close_text()
    return [c async for c in stream]


TEXTS = ("Sure, I can help you with that today. ", "Anything else you need from me?")


@pytest.mark.parametrize("aligner_kind", ["tiny", "tones", "spread"])
async def test_sync_words_precede_their_audio_with_probes_of_late_words(tiny, aligner_kind):
    aligner = {"tiny": tiny, "tones": ToneAligner(), "spread": SpreadAligner()}[aligner_kind]
    engine = AlignedEngine(LateWordsEngine(chunk_ms=80, step_s=0.004), aligner)
    await engine.start()
    try:
        chunks = await speak(engine, "s", "sync", TEXTS)
    finally:
        await engine.stop()
    text = "".join(TEXTS)
    words = [w for c in chunks for w in c.words]
    total = sum(len(c.samples) for c in chunks)
    assert chunks[-1].final and [w.text for w in words] == text.split()
    assert all(text[w.char_start : w.char_end] == w.text for w in words)
    assert all(0 <= w.start_sample <= w.end_sample <= total for w in words)
    assert all(a.start_sample <= b.start_sample for a, b in zip(words, words[1:], strict=False))
    words_lead_audio(chunks)
    assert engine.load().extra["aligner_jobs"] >= 1


async def test_async_mode_is_unchanged_by_probes(tiny):
    plain = LateWordsEngine(chunk_ms=80, step_s=0.004)
    await plain.start()
    reference = await speak(plain, "ref", "async", TEXTS)
    aligner = ToneAligner()
    engine = AlignedEngine(LateWordsEngine(chunk_ms=80, step_s=0.004), aligner)
    await engine.start()
    try:
        chunks = await speak(engine, "a", "async", TEXTS)
    finally:
        await engine.stop()
    audio = np.concatenate([c.samples for c in chunks])
    assert np.array_equal(audio, np.concatenate([c.samples for c in reference]))
    assert [b for batch in aligner.batches for b in batch] == list(TEXTS)  # one job per segment
    assert engine.load().extra["aligner_probes"] == 0
    sent = 0
    for c in chunks:  # words follow the audio they describe, in words-only chunks
        sent += len(c.samples)
        if c.words:
            assert len(c.samples) == 0 and c.words[-1].end_sample <= sent
