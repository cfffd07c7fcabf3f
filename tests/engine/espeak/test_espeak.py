"""The eSpeak engine, with the real libespeak-ng from the espeakng-loader wheel."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.api import (
    AudioChunk,
    Engine,
    InvalidRequest,
    Overloaded,
    Priority,
    SynthesisRequest,
    TextSegment,
    UnknownVoice,
    WordTiming,
)
from engine.espeak.engine import SAMPLES_PER_FRAME, EspeakEngine, EspeakStream, pause_after
from engine.espeak.lib import library
from engine.espeak.text import WordTracker, script_language, split_sentences, word_spans

EN = "Hello there, how are you today? The quick brown fox jumps over the lazy dog."
ZH = "今天天气很好，我们一起去公园散步吧。语音合成可以离线运行。"


@pytest.fixture
async def engine() -> AsyncIterator[EspeakEngine]:
    eng = EspeakEngine(max_streams=4, queue_limit=2)
    await eng.start()
    yield eng
    await eng.stop()


async def collect(stream: object) -> tuple[np.ndarray, list[WordTiming], list[AudioChunk]]:
    chunks = [chunk async for chunk in stream]  # type: ignore[attr-defined]
    audio = np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)
    words = [w for c in chunks for w in c.words]
    return audio, words, chunks


async def speak(eng: EspeakEngine, segments: list[TextSegment], **request: object) -> tuple:
    stream = eng.open(SynthesisRequest("r", **request))  # type: ignore[arg-type]
    for segment in segments:
        stream.push(segment)
    stream.close_text()
    return await collect(stream)


# -- pure helpers ---------------------------------------------------------------------------------
def test_sentences_cover_text_and_cut_after_punctuation() -> None:
    text = "One. Two?  三。四！ five"
    spans = split_sentences(text)
    assert [text[a:b] for a, b in spans] == ["One. ", "Two?  ", "三。", "四！ ", "five"]
    assert spans[0][0] == 0 and spans[-1][1] == len(text)


def test_sentences_do_not_end_at_abbreviations_or_initials() -> None:
    text = "Mr. Smith met Dr. J. Doe, e.g. at noon. Done."
    assert [text[a:b] for a, b in split_sentences(text)] == [
        "Mr. Smith met Dr. J. Doe, e.g. at noon. ",
        "Done.",
    ]


def test_word_spans_strip_punctuation_and_cut_cjk_runs() -> None:
    text = "“Quoted,” she said—twice. 你好，世界。"
    assert [text[a:b] for a, b in word_spans(text)] == ["Quoted", "she", "said", "twice", "你好", "世界"]


def test_script_picks_language() -> None:
    assert script_language("Hello there") == "en-us"
    assert script_language("你好，世界") == "cmn"
    assert script_language("こんにちは世界") == "ja"
    assert script_language("안녕하세요") == "ko"
    assert script_language("Привет") == "ru"


def test_pause_only_after_punctuation() -> None:
    assert pause_after("Done. ") > pause_after("well, ") > pause_after("and then ") == 0


def test_tracker_interpolates_words_without_events_and_cuts_cjk() -> None:
    tracker = WordTracker("tout le monde, ok", origin=1000)
    assert tracker.on_event(0, 1000) == []
    finished = tracker.on_event(15, 1300)  # "ok": no events for "le" and "monde"
    assert [(s.start_char, s.end_char) for s in finished] == [(0, 4), (5, 7), (8, 13)]
    starts = [s.start_sample for s in finished]
    assert starts == sorted(starts) and starts[0] == 1000 and finished[-1].end_sample == 1300
    assert [(s.start_char, s.start_sample, s.end_sample) for s in tracker.finish(1500)] == [(15, 1300, 1500)]

    cjk = WordTracker("一起去", origin=0)
    cjk.on_event(0, 0)
    assert [(s.start_char, s.end_char) for s in cjk.on_event(2, 480)] == [(0, 2)]  # 一起 grouped
    assert cjk.open_from == 480


def test_tracker_ignores_repeated_positions() -> None:
    tracker = WordTracker("1,234 items", origin=0)
    tracker.on_event(0, 0)
    assert tracker.on_event(0, 100) == [] and tracker.on_event(0, 200) == []
    assert [s.end_sample for s in tracker.on_event(6, 300)] == [300]


# -- the engine -----------------------------------------------------------------------------------
async def test_engine_satisfies_contract(engine: EspeakEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.info.name == "espeak" and engine.info.sample_rate == 24_000
    assert engine.load().ready and engine.load().capacity == 4


@pytest.mark.parametrize("text", [EN, ZH])
async def test_words_monotonic_inside_audio_and_point_at_client_text(engine: EspeakEngine, text: str) -> None:
    prefix = "Earlier text. "  # this segment sits at offset len(prefix) of the client's utterance
    client_text = prefix + text
    audio, words, chunks = await speak(engine, [TextSegment(text, char_start=len(prefix))])
    assert chunks[-1].final and len(audio) > 24_000
    offsets = [c.sample_offset for c in chunks]
    assert offsets == list(np.cumsum([0] + [len(c.samples) for c in chunks[:-1]]))
    expected = [text[a:b] for a, b in word_spans(text)]
    # every word of the text is covered, in order (CJK runs are cut further at eSpeak's words)
    assert "".join(w.text for w in words) == "".join(expected)
    if text == EN:
        assert [w.text for w in words] == expected
    for w in words:
        assert client_text[w.char_start : w.char_end] == w.text
        assert 0 <= w.start_sample < w.end_sample <= len(audio)
    starts = [w.start_sample for w in words]
    assert starts == sorted(starts)
    assert all(a.end_sample <= b.start_sample for a, b in zip(words, words[1:], strict=False))


async def test_words_arrive_no_later_than_their_audio(engine: EspeakEngine) -> None:
    _, _, chunks = await speak(engine, [TextSegment(EN, 0)])
    sent = 0
    for chunk in chunks:
        for word in chunk.words:
            assert word.start_sample >= sent  # none of its audio went out before it
        sent += len(chunk.samples)


async def test_char_map_is_honoured(engine: EspeakEngine) -> None:
    # the gateway removed markup: "<b>Hi</b> there." -> "Hi there."
    client = "<b>Hi</b> there."
    clean = "Hi there."
    char_map = (3, 4, 9, 10, 11, 12, 13, 14, 15)
    _, words, _ = await speak(engine, [TextSegment(clean, 0, char_map=char_map)])
    assert [client[w.char_start : w.char_end] for w in words] == ["Hi", "there"]


async def test_audio_is_resampled_to_24k(engine: EspeakEngine) -> None:
    native: list[np.ndarray] = []
    library().synthesize("The quick brown fox.", "en-us", 175, lambda pcm, ev: bool(native.append(pcm)))
    native_len = sum(len(p) for p in native)
    assert library().sample_rate == 22_050
    audio, _, _ = await speak(engine, [TextSegment("The quick brown fox.", 0)], language="English")
    assert abs(len(audio) - native_len * 24_000 / 22_050) < 0.01 * len(audio)
    assert audio.dtype == np.float32 and 0.05 < np.abs(audio).max() <= 1.0


async def test_mandarin_by_name_and_auto_give_same_words(engine: EspeakEngine) -> None:
    _, auto_words, _ = await speak(engine, [TextSegment(ZH, 0)])
    _, named_words, _ = await speak(engine, [TextSegment(ZH, 0)], language="Chinese")
    assert [w.text for w in auto_words] == [w.text for w in named_words]
    assert any(len(w.text) == 2 for w in auto_words)  # grouped dictionary words (一起, 可以)


async def test_segments_continue_the_timeline(engine: EspeakEngine) -> None:
    first, second = "First part, ", "and the second part."
    audio, words, _ = await speak(engine, [TextSegment(first, 0), TextSegment(second, len(first))])
    client = first + second
    assert [client[w.char_start : w.char_end] for w in words] == [
        "First",
        "part",
        "and",
        "the",
        "second",
        "part",
    ]
    assert words[2].start_sample > words[1].end_sample  # after the clause pause
    assert words[-1].end_sample <= len(audio)


async def test_cancel_stops_within_a_sentence(engine: EspeakEngine) -> None:
    long_sentence = " ".join(["word"] * 600) + "."
    began = time.perf_counter()
    await speak(engine, [TextSegment(long_sentence, 0)])
    full_s = time.perf_counter() - began

    stream = engine.open(SynthesisRequest("long"))
    stream.push(TextSegment(long_sentence, 0))
    stream.close_text()
    received = 0
    began = time.perf_counter()
    async for chunk in stream:
        received += len(chunk.samples)
        stream.cancel()
    # the worker is free again long before the sentence would have finished
    _, words, _ = await speak(engine, [TextSegment("Next.", 0)])
    after_cancel_s = time.perf_counter() - began
    assert words and words[0].text == "Next"
    assert after_cancel_s < full_s / 3, (after_cancel_s, full_s)
    assert received < 24_000 * 5


async def test_two_concurrent_requests_are_not_corrupted(engine: EspeakEngine) -> None:
    alone_en = await speak(engine, [TextSegment(EN, 0)])
    alone_zh = await speak(engine, [TextSegment(ZH, 0)])
    both = await asyncio.gather(
        speak(engine, [TextSegment(EN, 0)]),
        speak(engine, [TextSegment(ZH, 0)]),
    )
    for (audio, words, _), (ref_audio, ref_words, _) in zip(both, (alone_en, alone_zh), strict=True):
        assert [w.text for w in words] == [w.text for w in ref_words]
        assert abs(len(audio) - len(ref_audio)) < 0.01 * len(ref_audio)
        # eSpeak is not bit-exact between calls (its flutter state), so compare 20 ms energy envelopes
        n = min(len(audio), len(ref_audio)) // 480 * 480
        envelope = np.sqrt((audio[:n].reshape(-1, 480) ** 2).mean(axis=1))
        ref_envelope = np.sqrt((ref_audio[:n].reshape(-1, 480) ** 2).mean(axis=1))
        assert np.corrcoef(envelope, ref_envelope)[0, 1] > 0.9


async def test_forced_frames_gives_exact_length(engine: EspeakEngine) -> None:
    for frames in (5, 200):  # shorter than the speech (cut) and longer (padded)
        audio, words, _ = await speak(engine, [TextSegment(EN, 0)], forced_frames=frames)
        assert len(audio) == frames * SAMPLES_PER_FRAME
        assert all(w.end_sample <= len(audio) for w in words)


async def test_admission_and_validation(engine: EspeakEngine) -> None:
    with pytest.raises(UnknownVoice):
        engine.open(SynthesisRequest("x", voice="nobody"))
    with pytest.raises(InvalidRequest):
        engine.open(SynthesisRequest("x", language="Klingon"))
    with pytest.raises(InvalidRequest):
        engine.open(SynthesisRequest("x", speed=10.0))
    engine.open(SynthesisRequest("x", language="fr")).cancel()  # any eSpeak code works too
    streams = [engine.open(SynthesisRequest(f"s{i}", priority=Priority.BULK)) for i in range(6)]
    load = engine.load()
    assert (load.active, load.queued) == (4, 2)
    with pytest.raises(Overloaded):
        engine.open(SynthesisRequest("one too many"))
    streams[0].cancel()
    assert engine.load().queued == 1  # a waiting stream took the freed slot
    for stream in streams[1:]:
        stream.push(TextSegment("Hi.", 0))
        stream.close_text()
    results = await asyncio.gather(*(collect(s) for s in streams[1:]))
    assert all(r[1][0].text == "Hi" for r in results)


async def test_voices_and_speed_change_audio(engine: EspeakEngine) -> None:
    normal, _, _ = await speak(engine, [TextSegment(EN, 0)])
    fast, _, _ = await speak(engine, [TextSegment(EN, 0)], speed=2.0)
    female, words, _ = await speak(engine, [TextSegment(EN, 0)], voice="female")
    assert len(fast) < 0.7 * len(normal)
    assert words and len(female) > 0


async def test_a_new_request_goes_before_the_next_sentences_of_running_ones() -> None:
    engine = EspeakEngine(max_streams=16)
    await engine.start()
    served: list[str] = []
    all_started = threading.Event()
    speak_one = engine._speak

    def logged(stream: EspeakStream, *piece: object) -> None:
        served.append(stream.request_id)
        if len(served) >= 20:  # every long one has had two sentences
            all_started.set()
        speak_one(stream, *piece)  # type: ignore[arg-type]

    engine._speak = logged  # type: ignore[method-assign]
    paragraph = " ".join(f"This is sentence number {i} of a long paragraph." for i in range(20))
    running = [engine.open(SynthesisRequest(f"long{i}")) for i in range(10)]
    for stream in running:
        stream.push(TextSegment(paragraph, 0))
        stream.close_text()
    drains = [asyncio.ensure_future(collect(stream)) for stream in running]
    await asyncio.to_thread(all_started.wait, 10)
    new = engine.open(SynthesisRequest("new"))
    opened_at = len(served)
    new.push(TextSegment("Hello.", 0))
    new.close_text()
    await collect(new)
    await asyncio.gather(*drains)
    await engine.stop()
    assert served.index("new") - opened_at <= 2  # not behind the 10 running streams' next sentences


async def test_a_dead_worker_thread_reports_not_ready() -> None:
    """The gateway's supervisor restarts an engine that stops being ready: a worker thread that died
    must show in load()."""
    engine = EspeakEngine()
    await engine.start()
    try:
        assert engine.load().ready
        thread = engine._thread
        assert thread is not None
        engine._thread = threading.Thread(target=lambda: None)  # a worker that has ended
        engine._thread.start()
        engine._thread.join()
        assert not engine.load().ready
        engine._thread = thread
    finally:
        await engine.stop()
