"""The load test's words-vs-audio figures: each word's `words` event against the packet holding its
first sample, and their percentiles per point."""

from __future__ import annotations

import pytest

from clients.loadtest import build_parser, session_options
from clients.loadtest_report import RequestRecord, summarize, word_lags_ms

RATE = 24_000
PACKET = 480  # 20 ms


def test_each_word_is_timed_against_the_packet_holding_its_first_sample() -> None:
    packets = [((i + 1) * PACKET, 10.0 + 0.02 * i) for i in range(10)]  # 200 ms, a packet every 20 ms
    words = [
        (9.95, [0, 30]),  # before any audio: -50 ms behind packet 0, -70 ms behind packet 1
        (10.1, [40]),  # packet 2 (40-60 ms) came at 10.04: 60 ms late
        (10.5, [199, 200, 250]),  # packet 9; 200 ms is past the last packet: left out
    ]
    assert word_lags_ms(packets, words, RATE) == pytest.approx((-50.0, -70.0, 60.0, 320.0))
    assert word_lags_ms([], words, RATE) == ()


def record(lags: tuple[float, ...], ended: float = 1.0) -> RequestRecord:
    return RequestRecord(0, 100, 2.0, ended, ended + 0.1, ended + 1.0, 0, word_lags_ms=lags)


def test_a_point_gives_the_words_lag_percentiles_and_the_share_that_came_first() -> None:
    records = [record((-20.0, -10.0, 0.0)), record((10.0, 30.0)), record((500.0,), ended=0.5)]  # warm-up
    point = summarize(2, records, window=(1.0, 5.0))
    assert point["words_timed"] == 5
    assert point["words_lag_ms_p50"] == 0.0
    assert point["words_lag_ms_p90"] == pytest.approx(22.0)
    assert point["words_before_audio_pct"] == 60.0
    empty = summarize(2, [record(())], window=(0.0, 5.0))
    assert empty["words_timed"] == 0 and empty["words_lag_ms_p90"] is None
    assert empty["words_before_audio_pct"] is None


def test_the_sessions_alignment_is_an_option() -> None:
    args = build_parser().parse_args(["--alignment", "sync", "--voice", "ryan"])
    assert session_options(args) == {
        "pacing": "asap",
        "timestamps": "word",
        "voice": "ryan",
        "alignment": "sync",
    }
    assert "alignment" not in session_options(build_parser().parse_args([]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--alignment", "later"])
