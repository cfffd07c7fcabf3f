"""Barge-in: played position -> last word, partial word, spoken / unspoken text."""

from __future__ import annotations

import pytest

from gateway.bargein import Cut, Report, cut_at, played_position, resume_offset
from gateway.messages import Word

TEXT = "Sure, I can help you with that."
WORDS = [
    Word(0, "Sure,", 0, 310, 0, 5),
    Word(1, "I", 350, 420, 6, 7),
    Word(2, "can", 450, 650, 8, 11),
    Word(3, "help", 700, 910, 12, 16),
    Word(4, "you", 930, 1100, 17, 20),
    Word(5, "with", 1150, 1350, 21, 25),
    Word(6, "that.", 1400, 1700, 26, 31),
]


def test_the_protocols_example() -> None:
    cut = cut_at(WORDS, TEXT, 960)
    assert cut.last_word == WORDS[3]
    assert cut.partial_word == WORDS[4]
    assert cut.spoken_text == "Sure, I can help"
    assert cut.unspoken_text == " you with that."


def test_end_tolerance_is_40_ms() -> None:
    assert cut_at(WORDS, TEXT, 870).last_word == WORDS[3]  # 910 <= 870 + 40
    assert cut_at(WORDS, TEXT, 869).last_word == WORDS[2]
    assert cut_at(WORDS, TEXT, 869).partial_word == WORDS[3]


def test_a_word_within_tolerance_is_not_also_partial() -> None:
    cut = cut_at(WORDS, TEXT, 890)
    assert cut.last_word == WORDS[3] and cut.partial_word is None


def test_in_a_gap_there_is_no_partial_word() -> None:
    cut = cut_at(WORDS, TEXT, 680)
    assert cut.last_word == WORDS[2] and cut.partial_word is None


def test_nothing_heard() -> None:
    cut = cut_at(WORDS, TEXT, 0)
    assert cut.last_word is None
    assert cut.partial_word == WORDS[0]
    assert cut.spoken_text == "" and cut.unspoken_text == TEXT


def test_everything_heard() -> None:
    cut = cut_at(WORDS, TEXT, 5000)
    assert cut.last_word == WORDS[6] and cut.partial_word is None
    assert cut.spoken_text == TEXT and cut.unspoken_text == ""


def test_no_words_at_all() -> None:
    assert cut_at([], "abc", 100) == Cut(None, None, "", "abc")


@pytest.mark.parametrize("played", range(0, 1800, 37))
def test_spoken_plus_unspoken_is_the_text(played: int) -> None:
    cut = cut_at(WORDS, TEXT, played)
    assert cut.spoken_text + cut.unspoken_text == TEXT
    if cut.last_word:
        assert cut.last_word.end_ms <= played + 40
        later = [w for w in WORDS if w.index > cut.last_word.index]
        assert all(w.end_ms > played + 40 for w in later)


def test_client_position_wins_and_is_capped_at_what_was_sent() -> None:
    assert played_position(client_ms=500, report=Report(100, 0.0), first_sent_at=0.0, sent_ms=800, now=9) == (
        500,
        "client",
    )
    assert played_position(client_ms=5000, report=None, first_sent_at=None, sent_ms=800, now=0) == (
        800,
        "client",
    )


def test_report_is_extrapolated_at_real_time_and_capped() -> None:
    assert played_position(
        client_ms=None, report=Report(400, 10.0), first_sent_at=9.0, sent_ms=2000, now=10.25
    ) == (650, "report")
    assert played_position(
        client_ms=None, report=Report(400, 10.0), first_sent_at=9.0, sent_ms=500, now=11.0
    ) == (500, "report")


def test_server_estimate_from_first_packet() -> None:
    assert played_position(client_ms=None, report=None, first_sent_at=2.0, sent_ms=5000, now=2.3) == (
        300,
        "server",
    )
    assert played_position(client_ms=None, report=None, first_sent_at=2.0, sent_ms=100, now=2.3) == (
        100,
        "server",
    )
    assert played_position(client_ms=None, report=None, first_sent_at=None, sent_ms=0, now=5.0) == (
        0,
        "server",
    )


def test_resume_starts_at_the_partial_word() -> None:
    cut = cut_at(WORDS, TEXT, 960)
    assert TEXT[resume_offset(WORDS, TEXT, cut) :] == "you with that."


def test_resume_starts_at_the_next_word_in_a_gap() -> None:
    cut = cut_at(WORDS, TEXT, 680)
    assert TEXT[resume_offset(WORDS, TEXT, cut) :] == "help you with that."


def test_resume_past_the_timed_words_skips_punctuation_and_spaces() -> None:
    words = WORDS[:2]
    cut = cut_at(words, TEXT, 5000)
    assert TEXT[resume_offset(words, TEXT, cut) :] == "can help you with that."
    cut = cut_at(WORDS[:1], TEXT, 5000)
    assert TEXT[resume_offset(WORDS[:1], TEXT, cut) :] == "I can help you with that."


def test_resume_from_nothing_heard_is_the_whole_text() -> None:
    cut = cut_at(WORDS, TEXT, 0)
    assert resume_offset(WORDS, TEXT, cut) == 0


def test_word_to_wire() -> None:
    assert WORDS[3].to_wire() == {
        "index": 3,
        "text": "help",
        "start_ms": 700,
        "end_ms": 910,
        "char_start": 12,
        "char_end": 16,
    }


def test_a_known_last_word_heard_bounds_the_cut() -> None:
    cut = cut_at(WORDS, TEXT, 1000, heard_index=2)  # marks back up to "can"
    assert cut.last_word == WORDS[2] and cut.spoken_text == "Sure, I can"
    assert cut.partial_word == WORDS[4]  # being spoken at 1000
    assert cut_at(WORDS, TEXT, 1120, heard_index=-1).last_word is None


def test_the_server_clock_runs_from_where_an_unpause_left_the_listener() -> None:
    played = played_position(
        client_ms=None, report=None, first_sent_at=10.0, sent_ms=5000, now=10.25, start_ms=800
    )
    assert played == (1050, "server")
    assert played_position(
        client_ms=None, report=None, first_sent_at=None, sent_ms=300, now=1.0, start_ms=800
    ) == (
        300,
        "server",
    )
