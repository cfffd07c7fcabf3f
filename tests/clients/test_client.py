"""Client pieces without sockets: the playback clock, event and packet decoding, load-test figures."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from clients.client import (
    Done,
    Error,
    Interrupted,
    Paused,
    PlaybackClock,
    Started,
    Unpaused,
    Word,
    Words,
    decode_event,
    decode_packet,
)
from clients.loadtest_report import (
    RequestRecord,
    goodput_of_peak,
    headline,
    percentile,
    summarize,
    usd_per_m_chars,
)

RATE = 24_000
PACKET = 480  # 20 ms


# -- PlaybackClock -------------------------------------------------------------------------------
def test_clock_starts_after_buffer_and_runs_at_real_time() -> None:
    clock = PlaybackClock(RATE, buffer_ms=150)
    assert clock.played_ms(at=5.0) == 0  # nothing received yet
    for _ in range(50):  # 1 s of audio, all at t=0
        clock.on_packet(PACKET, at=0.0)
    assert clock.played_ms(at=0.1) == 0  # still buffering
    assert clock.played_ms(at=0.15) == 0
    assert clock.played_ms(at=0.65) == 500
    assert clock.played_ms(at=10.0) == 1000  # never past what was received
    assert clock.underruns == 0


def test_clock_stalls_on_underrun_and_resumes_when_audio_comes() -> None:
    clock = PlaybackClock(RATE, buffer_ms=100)
    clock.on_packet(PACKET, at=0.0)  # 20 ms of audio; playback starts at 0.1, dry at 0.12
    assert clock.played_ms(at=0.5) == 20
    clock.on_packet(PACKET, at=0.5)  # late: an underrun, playback resumes now
    assert clock.underruns == 1
    assert clock.first_underrun_s == pytest.approx(0.02) and clock.stall_s == pytest.approx(0.38)
    assert clock.played_ms(at=0.51) == 30
    assert clock.played_ms(at=0.6) == 40


def test_clock_records_where_it_first_ran_dry_and_how_long_it_stalled() -> None:
    now = 0.0
    clock = PlaybackClock(1000, buffer_ms=125, clock=lambda: now)  # 1 sample = 1 ms; exact floats
    # (arrival s, samples): playback starts at 0.125; dry at 0.875 (750 played), packet at 1.0;
    # resumed at 1.0 from 750, dry again at 1.75 (1500 played), packet at 2.25
    for at, samples in [(0.0, 500), (0.5, 250), (1.0, 250), (1.125, 500), (2.25, 250)]:
        now = at
        clock.on_packet(samples)
    assert clock.underruns == 2
    assert clock.first_underrun_s == 0.75
    assert clock.stall_s == 0.125 + 0.5
    assert clock.played_samples() == 1500  # at 2.25, just resumed


def test_packets_in_time_are_no_underrun() -> None:
    clock = PlaybackClock(RATE, buffer_ms=150)
    for i in range(100):  # real-time delivery with 30 ms of jitter: the buffer absorbs it
        clock.on_packet(PACKET, at=i * 0.02 + (0.03 if i % 7 == 3 else 0.0))
    assert clock.underruns == 0
    assert clock.first_underrun_s is None and clock.stall_s == 0.0
    assert clock.played_ms(at=100.0) == 2000


def test_slow_delivery_counts_underruns() -> None:
    clock = PlaybackClock(RATE, buffer_ms=50)
    for i in range(20):  # 20 ms of audio every 40 ms: the player keeps running dry
        clock.on_packet(PACKET, at=i * 0.04)
    assert clock.underruns > 5


# -- decoding ----------------------------------------------------------------------------------
def test_packet_header_is_parsed() -> None:
    payload = struct.pack("<4h", 1, -1, 2, -2)
    frame = struct.pack("<BBHII", 1, 1, 7, 42, 20_160) + payload
    packet = decode_packet(frame, "u1", bytes_per_sample=2, at=3.5)
    assert (packet.stream, packet.seq, packet.sample_offset, packet.last) == (7, 42, 20_160, True)
    assert packet.payload == payload and packet.samples == 4 and packet.received_at == 3.5
    not_last = decode_packet(struct.pack("<BBHII", 1, 0, 7, 43, 0), "u1", 2, 0.0)
    assert not not_last.last and not_last.samples == 0
    with pytest.raises(ValueError):
        decode_packet(b"\x01\x00", "u1", 2, 0.0)


def test_server_messages_become_typed_events() -> None:
    word = {"index": 3, "text": "help", "start_ms": 700, "end_ms": 910, "char_start": 12, "char_end": 16}
    assert decode_event({"type": "utterance.started", "utterance_id": "u1", "stream": 7}) == Started("u1", 7)
    words = decode_event({"type": "words", "utterance_id": "u1", "source": "engine", "words": [word]})
    assert words == Words("u1", "engine", (Word(3, "help", 700, 910, 12, 16),))
    done = decode_event({"type": "utterance.done", "utterance_id": "u1", "duration_ms": 4000, "packets": 200})
    assert done == Done("u1", 4000, 200)
    interrupted = decode_event(
        {
            "type": "utterance.interrupted",
            "utterance_id": "u1",
            "played_ms": 960,
            "position_source": "client",
            "last_word": word,
            "partial_word": None,
            "spoken_text": "Sure, I can help",
            "unspoken_text": " you.",
        }
    )
    assert isinstance(interrupted, Interrupted)
    assert interrupted.last_word == Word(3, "help", 700, 910, 12, 16) and interrupted.partial_word is None
    error = decode_event({"type": "error", "code": "overloaded", "message": "busy", "utterance_id": "u2"})
    assert error == Error("overloaded", "busy", "u2")
    assert decode_event({"type": "session.ended"}) is None


def test_client_does_not_import_torch() -> None:
    code = "import sys, clients.client, clients.say, clients.loadtest; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- load-test figures -------------------------------------------------------------------------------
def record(ended: float, ttfa: float, duration: float, audio_s: float, underruns: int = 0) -> RequestRecord:
    return RequestRecord(0, 100, audio_s, ended, ended + ttfa, ended + duration, underruns)


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([10, 20], 90) == pytest.approx(19)
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_point_figures_follow_the_definitions() -> None:
    records = [
        record(ended=0.5, ttfa=0.05, duration=1.0, audio_s=2.0),  # warm-up: not in latency figures
        record(ended=1.0, ttfa=0.10, duration=1.0, audio_s=2.0),
        record(ended=2.0, ttfa=0.20, duration=2.0, audio_s=2.0, underruns=1),
        record(ended=3.0, ttfa=0.30, duration=1.0, audio_s=4.0),
        RequestRecord(0, 100, 0.0, 4.0, None, None, 0, error="overloaded"),
    ]
    point = summarize(8, records, window=(1.0, 5.0))
    assert point["requests"] == 3 and point["errors"] == 0 and point["refused"] == 1
    assert point["ttfa_p50_ms"] == 200.0
    assert point["rtf_p50"] == 0.5 and point["rtf_p90"] == pytest.approx(0.9)
    assert point["underrun_streams_pct"] == pytest.approx(33.33, abs=0.01)
    # completions inside [1, 5]: the warm-up one (at 1.5) and the three measured ones
    assert point["chars_per_s"] == 100.0 and point["audio_s_per_s"] == 2.5
    assert point["usd_per_m_chars"] == pytest.approx(usd_per_m_chars(100.0), abs=1e-4)
    assert usd_per_m_chars(594.0) == pytest.approx(3.04, abs=0.01)  # the Baseten anchor


def test_point_places_underruns_and_stalls() -> None:
    def stream(ended: float, first_underrun_s: float | None = None, stall_s: float = 0.0) -> RequestRecord:
        underruns = 0 if first_underrun_s is None else 1
        return RequestRecord(
            0, 100, 2.0, ended, ended + 0.1, ended + 1.0, underruns, None, first_underrun_s, stall_s
        )

    records = [
        stream(0.5, first_underrun_s=0.1, stall_s=5.0),  # warm-up: left out
        stream(1.0),
        stream(1.5, first_underrun_s=0.5, stall_s=0.2),
        stream(2.0, first_underrun_s=3.0, stall_s=0.1),
        stream(2.5, first_underrun_s=1.0, stall_s=0.4),  # at the 1 s mark: still start-of-stream
        stream(3.0),
        RequestRecord(0, 100, 0.0, 3.5, None, None, 0, error="overloaded"),
    ]
    point = summarize(8, records, window=(1.0, 5.0))
    assert point["requests"] == 5 and point["underrun_streams_pct"] == 60.0
    assert point["underrun_first_s_p50"] == 1.0  # median of 0.5, 3.0, 1.0
    assert point["underrun_in_first_s_pct"] == 40.0  # 2 of 5 good streams
    # stalls in ms: 0, 0, 100, 200, 400
    assert point["stall_ms_p90"] == 320.0 and point["stall_ms_p99"] == 392.0
    clean = summarize(8, [stream(1.0), stream(2.0)], window=(1.0, 5.0))
    assert clean["underrun_first_s_p50"] is None and clean["underrun_in_first_s_pct"] == 0.0
    assert clean["stall_ms_p90"] == 0.0 and clean["stall_ms_p99"] == 0.0
    empty = summarize(8, [], window=(1.0, 5.0))
    assert empty["underrun_in_first_s_pct"] is None and empty["stall_ms_p99"] is None


def test_headline_is_largest_passing_concurrency() -> None:
    def point(c: int, rtf: float, ttfa: float, underrun: float) -> dict[str, object]:
        return {
            "concurrency": c,
            "rtf_p90": rtf,
            "ttfa_p90_ms": ttfa,
            "underrun_streams_pct": underrun,
            "chars_per_s": c * 10.0,
            "usd_per_m_chars": 1.0 / c,
        }

    points = [point(1, 0.1, 50, 0), point(8, 0.5, 150, 0.5), point(32, 0.9, 250, 0), point(64, 1.2, 100, 0)]
    assert headline(points)["concurrency"] == 8
    assert headline([point(1, 2.0, 50, 0)])["concurrency"] == 0


def test_a_runs_recorded_command_names_no_machine_path() -> None:
    from clients.loadtest import command_line

    line = command_line(
        ["--concurrency", "1,64", "-o", "/srv/results/bench-1.7b.json", "--corpus", "deploy/x.jsonl"]
    )
    assert line.endswith("--concurrency 1,64 -o bench-1.7b.json --corpus deploy/x.jsonl")
    assert "/srv" not in line


def test_a_runs_commit_may_be_named_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from clients.loadtest import run_metadata

    args = argparse.Namespace(gpu="none", model_shapes="1.7B")
    monkeypatch.setenv("CADENCE_COMMIT", "0123abc")
    assert run_metadata(args, {}, "cmd")["commit"] == "0123abc"
    monkeypatch.delenv("CADENCE_COMMIT")
    assert run_metadata(args, {}, "cmd")["commit"] != "0123abc"


def test_engine_figures_are_read_from_the_gateways_metrics() -> None:
    from prometheus_client import generate_latest

    from clients.loadtest import parse_engine_figures
    from engine.api import EngineLoad
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    extra = {"step_ms_decode": 7.25, "batch_sample": 256.0, "gpu_memory_peak_bytes": 5e10}
    metrics.observe_engine(EngineLoad(active=3, queued=1, capacity=8, queue_limit=4, extra=extra))
    assert parse_engine_figures(generate_latest(metrics.registry).decode()) == extra
    assert parse_engine_figures("cadence_engine_active 3.0\n") == {}


def test_cpu_shares_come_from_the_gateways_process_and_its_engine_workers() -> None:
    from prometheus_client import generate_latest

    from clients.loadtest import cpu_seconds, cpu_shares
    from engine.api import EngineLoad
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.observe_engine(
        EngineLoad(active=1, queued=0, capacity=8, queue_limit=4, extra={"worker_cpu_seconds": 12.5})
    )
    start = cpu_seconds(generate_latest(metrics.registry).decode())
    assert set(start) == {"gateway", "engine_workers"} and start["engine_workers"] == 12.5
    assert start["gateway"] > 0  # this test process's own CPU time so far
    end = {"gateway": start["gateway"] + 1.5, "engine_workers": 18.5}
    assert cpu_shares(start, end, 2.0) == {"gateway_cpu_pct": 75.0, "engine_workers_cpu_pct": 300.0}
    assert cpu_shares({}, end, 2.0) == {}  # nothing read at the window's start: no figure


def test_the_gateways_collector_pauses_are_read_from_its_metrics() -> None:
    from prometheus_client import generate_latest

    from clients.loadtest import gc_counts, gc_figures
    from gateway.gc_pauses import GcPauses
    from gateway.metrics import GatewayMetrics

    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    metrics = GatewayMetrics()

    def pause(generation: int, seconds: float) -> None:
        pauses._callback("start", {"generation": generation})
        now[0] += seconds
        pauses._callback("stop", {"generation": generation})

    assert gc_figures({}, gc_counts(generate_latest(metrics.registry).decode())) == {}  # not timed
    metrics.watch_gc(pauses)
    pause(0, 0.002)  # before the window
    start = gc_counts(generate_latest(metrics.registry).decode())
    assert start == {"count_0": 1.0, "seconds_0": 0.002, "longest_s": 0.002}
    pause(0, 0.003)
    pause(0, 0.001)
    pause(2, 0.25)
    assert gc_figures(start, gc_counts(generate_latest(metrics.registry).decode())) == {
        "gateway_gc_pause_longest_ms": 250.0,
        "gateway_gc_pauses": 3.0,
        "gateway_gc_pause_total_s": 0.254,
        "gateway_gc_pauses_gen0": 2.0,
        "gateway_gc_pause_s_gen0": 0.004,
        "gateway_gc_pauses_gen2": 1.0,
        "gateway_gc_pause_s_gen2": 0.25,
    }


def test_clock_holds_its_position_while_paused() -> None:
    clock = PlaybackClock(RATE, buffer_ms=0)
    for _ in range(100):  # 2 s of audio at t=0
        clock.on_packet(PACKET, at=0.0)
    clock.pause(at=0.5)
    assert clock.played_ms(at=0.5) == 500 and clock.played_ms(at=3.0) == 500
    clock.on_packet(PACKET, at=2.0)  # audio sent before the fence, arriving late: no underrun
    clock.resume(at=3.0)
    assert clock.played_ms(at=3.25) == 750 and clock.underruns == 0


def test_pause_messages_become_typed_events() -> None:
    word = {"index": 1, "text": "I", "start_ms": 350, "end_ms": 420, "char_start": 6, "char_end": 7}
    raw = {
        "type": "utterance.paused",
        "utterance_id": "u1",
        "played_ms": 500,
        "position_source": "client",
        "last_word": word,
        "partial_word": None,
        "spoken_text": "Sure, I",
        "unspoken_text": " can",
    }
    paused = decode_event(raw)
    assert paused == Paused("u1", 500, "client", Word(1, "I", 350, 420, 6, 7), None, "Sure, I", " can")
    assert decode_event({"type": "utterance.unpaused", "utterance_id": "u1"}) == Unpaused("u1")
    assert isinstance(decode_event({**raw, "type": "utterance.interrupted"}), Interrupted)


def test_queued_done_and_overloaded_events_carry_the_admission_figures() -> None:
    from clients.client import Done, Error, Queued, decode_event

    queued = decode_event(
        {"type": "utterance.queued", "utterance_id": "u1", "position": 2, "expected_wait_ms": 900}
    )
    assert isinstance(queued, Queued) and (queued.position, queued.expected_wait_ms) == (2, 900)
    done = decode_event(
        {"type": "utterance.done", "utterance_id": "u1", "duration_ms": 10, "packets": 1, "queued_ms": 850}
    )
    assert done == Done("u1", 10, 1, 850)
    plain = decode_event({"type": "utterance.done", "utterance_id": "u2", "duration_ms": 10, "packets": 1})
    assert isinstance(plain, Done) and plain.queued_ms == 0
    refused = decode_event({"type": "error", "code": "overloaded", "message": "m", "retry_after_ms": 1200})
    assert refused == Error("overloaded", "m", None, 1200)
    assert decode_event({"type": "error", "code": "internal", "message": "m"}) == Error("internal", "m")


def test_admission_figures_are_in_the_gateways_metrics() -> None:
    from prometheus_client import generate_latest

    from engine.admission import QUEUE_WAIT_BOUNDS_S
    from engine.api import AdmissionFigures, EngineLoad
    from gateway.metrics import GatewayMetrics, admission_summary

    counts = tuple(min(3, i) for i in range(len(QUEUE_WAIT_BOUNDS_S) + 1))
    figures = AdmissionFigures(
        capacity=5,
        max_streams=8,
        admitted=5,
        queued=2,
        queue_limit=4,
        admitted_total=40,
        queued_total=3,
        refused={"queue_full": 7, "max_wait": 1, "wait_expired": 0},
        wait_bounds_s=QUEUE_WAIT_BOUNDS_S,
        wait_counts=counts,
        wait_sum_s=1.5,
        wait_p50_s=0.25,
        wait_p90_s=0.8,
    )
    metrics = GatewayMetrics()
    assert "cadence_engine_refusals" not in generate_latest(metrics.registry).decode()  # none observed yet
    metrics.observe_engine(EngineLoad(active=5, queued=2, capacity=5, queue_limit=4, admission=figures))
    lines = set(generate_latest(metrics.registry).decode().splitlines())
    for line in (
        "cadence_engine_capacity 5.0",
        "cadence_engine_max_streams 8.0",
        "cadence_engine_queue_depth 2.0",
        "cadence_engine_queue_limit 4.0",
        "cadence_engine_admitted_total 40.0",
        "cadence_engine_queued_total 3.0",
        'cadence_engine_refusals_total{reason="queue_full"} 7.0',
        'cadence_engine_refusals_total{reason="max_wait"} 1.0',
        'cadence_engine_refusals_total{reason="wait_expired"} 0.0',
        'cadence_engine_queue_wait_seconds_bucket{le="0.025"} 1.0',
        'cadence_engine_queue_wait_seconds_bucket{le="+Inf"} 3.0',
        "cadence_engine_queue_wait_seconds_count 3.0",
        "cadence_engine_queue_wait_seconds_sum 1.5",
    ):
        assert line in lines, line
    summary = admission_summary(figures)
    assert (
        summary is not None
        and summary["queue_wait_p90_ms"] == 800.0
        and summary["refused"]["queue_full"] == 7
    )
    assert admission_summary(None) is None


def test_a_queued_request_counts_from_its_admission_and_its_wait_apart() -> None:
    at_once = record(ended=1.0, ttfa=0.10, duration=1.0, audio_s=2.0)
    waited = RequestRecord(
        0, 100, 2.0, 2.0, 2.0 + 3.05, 2.0 + 4.0, 0, queued=True, queued_s=3.0, answered_at=2.004
    )
    refused = RequestRecord(
        0, 100, 0.0, 2.5, None, None, 0, "overloaded", answered_at=2.51, retry_after_s=4.0
    )
    failed = RequestRecord(0, 100, 0.0, 2.6, None, None, 0, "internal")
    assert waited.ttfa_ms == pytest.approx(50.0) and waited.rtf == pytest.approx(0.5)
    point = summarize(8, [at_once, waited, refused, failed], window=(1.0, 10.0))
    assert (point["admitted"], point["queued"], point["refused"], point["errors"]) == (1, 1, 1, 1)
    assert point["queue_wait_p50_ms"] == 3000.0 and point["ttfa_p90_ms"] == pytest.approx(95.0)
    assert point["excess_answer_ms_p90"] == pytest.approx(9.4)  # 4 and 10 ms, interpolated
    points = [dict(point), {**point, "audio_s_per_s": 2 * point["audio_s_per_s"]}]
    goodput_of_peak(points)
    assert [p["goodput_pct_of_peak"] for p in points] == [50.0, 100.0]


def test_levels_may_follow_the_servers_capacity() -> None:
    from clients.loadtest import resolve_level

    assert resolve_level("256", None) == 256
    assert resolve_level("capacity", 700) == 700 and resolve_level("1.5x", 700) == 1050
    assert resolve_level(" 2x", 64) == 128
    with pytest.raises(SystemExit):
        resolve_level("2x", None)
    with pytest.raises(ValueError):
        resolve_level("lots", 64)
