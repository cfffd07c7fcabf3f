"""Segmentation of LLM token streams at the edges: contractions, list markers, numbers written with
full-width marks, and cuts forced by the length limit (never inside a number or a grapheme)."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import TextSegment
from gateway.segmenter import Segmenter, UtteranceText


def run(text: str, step: int = 1, **options: int) -> list[TextSegment]:
    seg = Segmenter(**options)
    out: list[TextSegment] = []
    for i in range(0, len(text), step):
        out += seg.feed(text[i : i + step])
    return out + seg.flush()


def texts(segments: list[TextSegment]) -> list[str]:
    return [s.text for s in segments]


# -- sentence ends that are not abbreviations ------------------------------------------------


@pytest.mark.parametrize("apostrophe", ["'", "’"])
def test_a_contraction_ending_a_sentence_is_not_an_initial(apostrophe: str) -> None:
    text = f"I don{apostrophe}t. But it{apostrophe}s fine. Ok"
    assert texts(run(text)) == [f"I don{apostrophe}t. ", f"But it{apostrophe}s fine. ", "Ok"]


def test_no_is_an_abbreviation_only_before_a_number() -> None:
    assert texts(run("The answer is no. You cannot go.")) == ["The answer is no. ", "You cannot go."]
    assert texts(run("Ticket No. 5 is yours. Bye")) == ["Ticket No. 5 is yours. ", "Bye"]


def test_no_waits_for_the_next_word_before_deciding() -> None:
    seg = Segmenter()
    assert seg.feed("Platform No. ") == []  # "No. 5" or "no. Then": not known yet
    assert seg.feed("9") == []
    assert texts(seg.feed(" leaves now. ")) == ["Platform No. 9 leaves now. "]


def test_dotted_acronyms_are_abbreviations_like_initials() -> None:
    assert texts(run("The U.S.A. and the U.K. are allies. Yes")) == [
        "The U.S.A. and the U.K. are allies. ",
        "Yes",
    ]


def test_numbered_list_markers_are_not_sentences() -> None:
    text = "Steps:\n1. Open the app.\n2. Tap Settings.\n10. Done\n"
    assert texts(run(text)) == ["Steps:\n", "1. Open the app.\n", "2. Tap Settings.\n", "10. Done\n"]
    for step in (2, 3, 7):
        assert texts(run(text, step=step)) == texts(run(text))


def test_a_number_ending_a_sentence_inside_a_line_still_ends_it() -> None:
    assert texts(run("The answer is 42. Anything else?")) == ["The answer is 42. ", "Anything else?"]


# -- full-width marks inside numbers ---------------------------------------------------------


def test_full_width_decimal_point_and_time_colon_do_not_split_numbers() -> None:
    assert texts(run("価格は３．５ドルです。次へ")) == ["価格は３．５ドルです。", "次へ"]
    assert texts(run("会议在10：30开始，请准时参加会议，谢谢大家", clause_min_chars=5)) == [
        "会议在10：30开始，",
        "请准时参加会议，",
        "谢谢大家",
    ]


# -- cuts forced by max_chars ----------------------------------------------------------------


def test_forced_cut_never_falls_inside_a_number_or_a_time() -> None:
    long = "we counted " + "many " * 10 + "items 1,000 at 10:30 and then more words"
    for segment in run(long, max_chars=80):
        assert not segment.text.endswith(("1,", "10:"))
    assert (
        texts(run("ab" * 40 + "1,000" + "cd" * 60, max_chars=100))[0] == "ab" * 40 + "1,000" + "cd" * 7 + "c"
    )


def test_forced_cut_still_prefers_a_clause_mark_followed_by_a_space() -> None:
    text = "first part, " + "word " * 30
    assert texts(run(text, max_chars=60, clause_min_chars=100))[0] == "first part,"


FAMILY = "👨\u200d👩\u200d👧\u200d👦"
GRAPHEMES = [
    FAMILY,
    "e\u0301",
    "👍🏽",
    "🇫🇷",
    "1\ufe0f\u20e3",
    "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
]


@pytest.mark.parametrize("cluster", GRAPHEMES, ids=ascii)
def test_a_hard_cut_never_splits_a_grapheme(cluster: str) -> None:
    for pad in range(95, 101):
        text = "x" * pad + cluster + "y" * 150
        segments = run(text, max_chars=100)
        assert "".join(texts(segments)) == text
        assert all(len(s.text) <= 100 for s in segments)
        assert any(cluster in s.text for s in segments), (pad, [ascii(s.text[-4:]) for s in segments])


def test_regional_indicator_pairs_stay_together() -> None:
    flags = "🇫🇷🇩🇪🇯🇵" * 20  # no spaces: only the hard cut applies
    for segment in run("x" + flags, max_chars=51):
        body = segment.text.lstrip("x")
        assert len(body) % 2 == 0, ascii(segment.text)


def _splits_a_grapheme(text: str, cut: int) -> bool:
    if cut <= 0 or cut >= len(text):
        return False
    before, after = text[cut - 1], text[cut]
    return (
        unicodedata.category(after) in ("Mn", "Me", "Mc")
        or "\u200d" in (before, after)
        or 0x1F3FB <= ord(after) <= 0x1F3FF
        or 0xE0020 <= ord(after) <= 0xE007F
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["a", "b", "你", " ", ",", ". ", "3.14", "1,000", "10:30", "\n", *GRAPHEMES]),
        max_size=120,
    ),
    st.integers(1, 9),
    st.integers(10, 60),
)
def test_segments_are_exact_slices_bounded_and_whole_graphemes(
    parts: list[str], step: int, max_chars: int
) -> None:
    text = "".join(parts)
    pipeline = UtteranceText("Auto", max_chars=max_chars, clause_min_chars=min(10, max_chars))
    segments: list[TextSegment] = []
    for i in range(0, len(text), step):
        segments += pipeline.feed(text[i : i + step])
    segments += pipeline.flush()
    covered = 0
    for s in segments:
        assert text[s.char_start : s.char_start + len(s.text)] == s.text
        assert text[covered : s.char_start].strip() == ""
        assert len(s.text) <= max_chars
        covered = s.char_start + len(s.text)
    assert text[covered:].strip() == ""
    longest = max((len(p) for p in parts), default=1)
    if max_chars >= 2 * longest:  # room to back off: no cut falls inside a cluster
        for s in segments:
            assert not _splits_a_grapheme(text, s.char_start)
            assert not _splits_a_grapheme(text, s.char_start + len(s.text))
