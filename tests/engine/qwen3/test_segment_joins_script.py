"""bench/gpu_segment_joins.py in smoke mode: a tiny random checkpoint on the CPU, two levels."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import gpu_segment_joins as joins
from engine.api import TextSegment, WordTiming

pytestmark = pytest.mark.timeout(120)


def test_paragraphs_are_cut_into_several_segments_with_their_forced_frames() -> None:
    texts = joins.load_texts(joins.CORPUS, max_frames=50)
    assert texts and all(len(t.segments) >= 2 and t.frames <= 50 for t in texts)
    for t in texts:
        assert "".join(s.text for s in t.segments) == t.text
    assert {t.language for t in texts} == {"English", "Chinese"}


def test_join_chunks_are_the_chunks_holding_each_segment_start() -> None:
    segments = (TextSegment("One two. ", 0), TextSegment("Three four.", 9))
    text = joins.Text("One two. Three four.", "English", 10, segments)
    start = joins.expected_starts(text)[1]  # 10 frames shared 4 / 6 by characters (8 / 11)
    assert start == 4 * 1920
    utt = joins.Utterance("u", text, final=True)
    # chunks at 0, 1, 3, 6 frames: the third (frames 3-5) holds the second segment's start
    utt.chunks = [(10.0, 0, 1920), (10.02, 1920, 3840), (10.10, 5760, 5760), (10.5, 11520, 7680)]
    utt.words = [WordTiming("Three", start, start + 1, 9, 14)]
    tally = joins.Tally()
    tally.add(utt)
    assert tally.join_late == [pytest.approx(0.10 - 5760 / 24000)]
    assert len(tally.other_late) == 2 and tally.other_late[-1] == pytest.approx(0.5 - 11520 / 24000)
    assert (tally.checked, tally.inserted_samples, tally.timeline_gaps) == (1, 0, 0)
    assert tally.starts_from_words == 1 and tally.starts_unlike_shares == 0


def test_an_inserted_pause_and_a_timeline_gap_are_caught() -> None:
    text = joins.Text("A b. C d.", "English", 2, (TextSegment("A b. ", 0), TextSegment("C d.", 5)))
    utt = joins.Utterance("u", text, final=True)
    utt.chunks = [(0.0, 0, 1920), (0.01, 1920 + 480, 1920)]
    tally = joins.Tally()
    tally.add(utt)
    assert tally.timeline_gaps == 1 and tally.inserted_samples == 480 and tally.length_mismatches == 1


def test_smoke_run_reports_joins_lateness_and_no_inserted_samples(tmp_path: Path) -> None:
    out, model = tmp_path / "joins.json", tmp_path / "tiny-random"
    report = joins.main(
        [
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--model",
            str(model),
            "--concurrency",
            "1,2",
            "--seconds",
            "0.5",
            "--level-timeout",
            "60",
            "--max-frames",
            "16",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert (model / "config.json").exists()  # written there, kept for the next run
    saved = json.loads(out.read_text())
    assert saved["levels"] and [r["concurrency"] for r in saved["levels"]] == [1, 2]
    assert saved["command"].endswith("--out joins.json")  # file names, not the machine's paths
    for level in report["levels"]:
        assert level["completed"] >= level["concurrency"] and level["cancelled"] == 0
        assert level["joins"] > 0 and level["at_joins"]["chunks"] == level["joins"]
        for key in ("at_joins", "other_chunks"):
            figures = level[key]
            assert all(math.isfinite(figures[k]) for k in ("p50_ms", "p90_ms", "max_ms", "late_over_20ms"))
            assert figures["p50_ms"] <= figures["p90_ms"] <= figures["max_ms"]
        audio = level["audio_length"]
        assert audio["utterances_checked"] == level["completed"]
        assert audio["inserted_samples"] == 0 and audio["mismatched_utterances"] == 0
        assert audio["timeline_gaps"] == 0
        assert level["segment_starts_from_words"] == level["segments"]  # every segment finished
        assert level["starts_unlike_shares"] == 0
