"""The Qwen3 engine's estimated words (no aligner): inside their segment's frames, spread by
characters, offsets into the client's text. Approximate by design (docs/timestamps.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from engine.api import TextSegment  # noqa: E402
from engine.qwen3.engine import estimate_words  # noqa: E402
from engine.qwen3.request import SAMPLES_PER_FRAME, Segment  # noqa: E402


def segment(text: str, first_frame: int, frames: int, char_start: int = 0, char_map=None) -> Segment:
    return Segment(
        TextSegment(text, char_start, char_map=char_map),
        prompt_len=0,
        max_frames=100,
        first_frame=first_frame,
        frames=frames,
    )


def test_words_tile_the_segments_frames_in_proportion_to_their_characters():
    words = estimate_words(segment("Hi there, everybody.", first_frame=5, frames=20, char_start=30))
    start, end = 5 * SAMPLES_PER_FRAME, 25 * SAMPLES_PER_FRAME
    assert [w.text for w in words] == ["Hi", "there,", "everybody."]
    assert words[0].start_sample == start and words[-1].end_sample == end  # bounded by the schedule
    assert all(a.end_sample == b.start_sample for a, b in zip(words, words[1:], strict=False))
    lengths = [w.end_sample - w.start_sample for w in words]
    chars = [2, 6, 10]
    for n, c in zip(lengths, chars, strict=True):
        assert abs(n - (end - start) * c / sum(chars)) <= 1
    assert [(w.char_start, w.char_end) for w in words] == [(30, 32), (33, 39), (40, 50)]
    assert {w.source for w in words} == {"estimate"}


def test_markup_removed_by_the_gateway_keeps_offsets_in_the_clients_text():
    words = estimate_words(segment("ab cd", 0, 4, char_map=(10, 11, 12, 20, 21)))
    assert [(w.char_start, w.char_end) for w in words] == [(10, 12), (20, 22)]


def test_unspaced_mandarin_is_one_estimated_unit_per_run():
    # a known limit of the estimate: without spaces a clause is one timed unit (the aligner splits
    # every ideograph); documented in docs/timestamps.md
    words = estimate_words(segment("今天天气很好，", 0, 10))
    assert [w.text for w in words] == ["今天天气很好，"]


def test_no_frames_no_words():
    assert estimate_words(segment("Hello", 0, 0)) == []
