"""bench/sync_release_sim.py: the real tracker fed at a speed, its jobs answered after a latency."""

from __future__ import annotations

import json

from bench.sync_release_sim import ROOT, main, prompts, simulate
from engine.alignment.engine import SYNC_SCHEDULE
from engine.api import ChunkSchedule

TEXT = (
    "Please arrive fifteen minutes early and bring your insurance card and a photo ID. "
    "Today's forecast calls for scattered showers in the morning, clearing by early afternoon."
)


def test_a_fast_engine_and_aligner_keep_the_listener_playing_after_the_probes_first_words():
    fast = simulate(TEXT, speed=50.0, latency_s=0.001, buffer_s=0.15)
    assert not fast["ran_dry"] and fast["releases"] > 2  # word by word, not one whole segment
    # the first release needs two probes: at least PROBE_MIN_S of audio, then PROBE_STEP_S more
    assert 0.75 / 50 * 1000 - 10 <= fast["added_ttfa_ms"] < 100


def test_an_engine_near_real_time_runs_the_listener_dry_and_slower_answers_add_to_first_audio():
    slow = simulate(TEXT, speed=1.5, latency_s=0.06, buffer_s=0.15, schedule=ChunkSchedule())
    assert slow["ran_dry"] and slow["latest_ms"] > 0
    later = simulate(TEXT, speed=1.5, latency_s=0.2, buffer_s=0.15, schedule=ChunkSchedule())
    assert later["added_ttfa_ms"] > slow["added_ttfa_ms"]


def test_the_command_writes_a_summary_per_speed_and_latency(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["--speed", "3", "--latency-ms", "30,90", "--prompts", "3", "-o", str(out)]) == 0
    written = json.loads(out.read_text())
    assert [(r["speed"], r["latency_ms"], r["prompts"]) for r in written["results"]] == [
        (3.0, 30.0, 3),
        (3.0, 90.0, 3),
    ]
    assert written["command"].startswith("python -m bench.sync_release_sim --speed 3")


def test_sync_streams_chunks_keep_listeners_playing_where_two_second_chunks_do_not():
    """Why the aligned engine asks the engine for chunks of at most 8 frames for sync streams: at 3x
    real time, 2-second chunks leave some listeners dry between probes; 8-frame chunks do not, and
    the first audio comes no later."""
    texts = prompts(ROOT / "deploy" / "bench" / "corpus.jsonl", 20)
    grown = [simulate(t, 3.0, 0.06, 0.15, ChunkSchedule()) for t in texts]
    sync = [simulate(t, 3.0, 0.06, 0.15, SYNC_SCHEDULE) for t in texts]
    assert sum(c["ran_dry"] for c in grown) > 0 and sum(c["ran_dry"] for c in sync) == 0
    assert sorted(c["added_ttfa_ms"] for c in sync) <= sorted(c["added_ttfa_ms"] for c in grown)
