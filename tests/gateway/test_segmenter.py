"""Incremental segmentation at sentence and clause boundaries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import TextSegment
from gateway.segmenter import Segmenter


def run(text: str, step: int = 1, **options: int) -> list[TextSegment]:
    seg = Segmenter(**options)
    out: list[TextSegment] = []
    for i in range(0, len(text), step):
        out += seg.feed(text[i : i + step])
    return out + seg.flush()


def texts(segments: list[TextSegment]) -> list[str]:
    return [s.text for s in segments]


def test_sentences_are_cut_after_trailing_space() -> None:
    assert texts(run("Hello there. How are you? Fine!")) == ["Hello there. ", "How are you? ", "Fine!"]


def test_char_start_points_into_the_clients_text() -> None:
    text = "One. Two three. Four."
    for s in run(text, step=3):
        assert text[s.char_start : s.char_start + len(s.text)] == s.text


def test_segment_completes_only_when_whitespace_confirms_the_boundary() -> None:
    seg = Segmenter()
    assert seg.feed("It costs 3.") == []
    assert seg.feed("14 dollars") == []
    assert texts(seg.feed(". Next")) == ["It costs 3.14 dollars. "]
    assert texts(seg.flush()) == ["Next"]


def test_numbers_are_never_split() -> None:
    assert texts(run("Pi is 3.14159 and e is 2.718 roughly, also 1,000,000 items.", clause_min_chars=5)) == [
        "Pi is 3.14159 and e is 2.718 roughly, ",
        "also 1,000,000 items.",
    ]


def test_abbreviations_and_initials_do_not_end_sentences() -> None:
    text = "Dr. Smith met Mrs. Jones, e.g. at noon. J. R. R. Tolkien wrote it."
    assert texts(run(text, clause_min_chars=300)) == [
        "Dr. Smith met Mrs. Jones, e.g. at noon. ",
        "J. R. R. Tolkien wrote it.",
    ]


def test_urls_are_never_split() -> None:
    text = "Visit https://example.com/a?b=1&c=2.html now. Or www.test.org: it works."
    assert texts(run(text, clause_min_chars=300)) == [
        "Visit https://example.com/a?b=1&c=2.html now. ",
        "Or www.test.org: it works.",
    ]


def test_clause_cut_needs_minimum_length() -> None:
    assert texts(run("Sure, I can help you with that, right away.", clause_min_chars=10)) == [
        "Sure, I can help you with that, ",
        "right away.",
    ]
    assert texts(run("Sure, I can help.", clause_min_chars=0)) == ["Sure, ", "I can help."]


def test_full_width_cjk_punctuation_cuts_without_spaces() -> None:
    assert texts(run("你好。今天天气很好！我们走吧？好", clause_min_chars=100)) == [
        "你好。",
        "今天天气很好！",
        "我们走吧？",
        "好",
    ]


def test_cjk_clause_marks() -> None:
    assert texts(run("第一部分很长很长，第二部分、第三", clause_min_chars=5)) == [
        "第一部分很长很长，",
        "第二部分、",
        "第三",
    ]


def test_closing_quotes_stay_with_their_sentence() -> None:
    assert texts(run('He said "stop." Then left.')) == ['He said "stop." ', "Then left."]
    assert texts(run("「你好。」他说。")) == ["「你好。」", "他说。"]


def test_ellipsis_and_repeated_marks() -> None:
    assert texts(run("Wait... What?! Really")) == ["Wait... ", "What?! ", "Really"]


def test_newline_is_a_boundary() -> None:
    assert texts(run("- first item\n- second item\n")) == ["- first item\n", "- second item\n"]


def test_max_length_cuts_at_a_space() -> None:
    words = " ".join(["word"] * 100)
    segments = run(words, max_chars=50)
    assert all(len(s.text) <= 50 for s in segments)
    assert "".join(texts(segments)) == words
    assert all(s.text.endswith(" ") for s in segments[:-1])


def test_max_length_hard_cut_without_spaces() -> None:
    segments = run("x" * 130, max_chars=50)
    assert texts(segments) == ["x" * 50, "x" * 50, "x" * 30]
    assert [s.char_start for s in segments] == [0, 50, 100]


def test_whitespace_only_is_not_a_segment_but_keeps_offsets() -> None:
    seg = Segmenter()
    assert seg.feed("   ") == []
    out = seg.flush()
    assert out == []
    assert texts(seg.feed("Hi. ")) == ["Hi. "]
    assert seg.flush() == []


def test_offsets_continue_after_flush() -> None:
    seg = Segmenter()
    seg.feed("Hello")
    first = seg.flush()
    second = seg.feed(" world. ")
    assert [(s.text, s.char_start) for s in first + second] == [("Hello", 0), (" world. ", 5)]


def test_pending_shows_unsegmented_text() -> None:
    seg = Segmenter()
    seg.feed("Done. Not yet")
    assert seg.pending == "Not yet"


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="ab .,!?。，\n3é", max_size=200), st.integers(1, 9), st.integers(5, 60))
def test_segments_tile_the_text_whatever_the_token_size(text: str, step: int, max_chars: int) -> None:
    segments = run(text, step=step, max_chars=max_chars, clause_min_chars=min(10, max_chars))
    covered = 0
    for s in segments:
        assert text[s.char_start : s.char_start + len(s.text)] == s.text
        assert s.char_start >= covered
        assert text[covered : s.char_start].strip() == ""
        assert len(s.text) <= max_chars
        covered = s.char_start + len(s.text)
    assert text[covered:].strip() == ""


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet="ab .,!?3", max_size=120), st.integers(1, 7))
def test_token_size_does_not_change_the_result(text: str, step: int) -> None:
    def shape(segments: list[TextSegment]) -> list[tuple[str, int]]:
        return [(s.text.strip(), s.char_start + len(s.text) - len(s.text.lstrip())) for s in segments]

    assert shape(run(text, step=step)) == shape(run(text, step=len(text) or 1))
