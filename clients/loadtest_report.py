"""Figures of a load-test point, the run's JSON and its plots (definitions: bench/README.md)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRICE_PER_HOUR_USD = 6.50  # an H100's list price per hour: the basis of the cost figures
REALTIME_RTF = 1.0
HEADLINE_TTFA_MS = 200.0
HEADLINE_UNDERRUN_PCT = 1.0
EARLY_UNDERRUN_S = 1.0  # a first underrun up to this audio position counts as start-of-stream


UNFINISHED = "unfinished"  # the error of a request still under way when the point's drain ended


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of the closed loop, as the load-test client measured it."""

    stream: int
    chars: int
    audio_s: float
    ended_at: float  # perf_counter when speak.end was sent
    first_packet_at: float | None
    last_packet_at: float | None
    underruns: int
    error: str | None = None
    first_underrun_s: float | None = None  # audio position of the first underrun
    stall_s: float = 0.0  # total time the player sat dry
    word_lags_ms: tuple[float, ...] = ()  # each word's `words` event after its first audio (word_lags_ms)
    queued: bool = False  # the server answered utterance.queued: it waited for admission
    queued_s: float = 0.0  # how long it waited (the server's utterance.done `queued_ms`)
    answered_at: float | None = None  # perf_counter of utterance.queued or of the refusal
    retry_after_s: float | None = None  # refused (overloaded): the server's retry_after_ms

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_packet_at is not None and self.audio_s > 0

    @property
    def refused(self) -> bool:
        return self.error == "overloaded"

    @property
    def admitted_at(self) -> float:
        """When the engine admitted it: speak.end, or the end of its wait in the queue."""
        return self.ended_at + self.queued_s

    @property
    def ttfa_ms(self) -> float:
        assert self.first_packet_at is not None
        return (self.first_packet_at - self.admitted_at) * 1000.0

    @property
    def rtf(self) -> float:
        assert self.last_packet_at is not None
        return (self.last_packet_at - self.admitted_at) / self.audio_s


def word_lags_ms(
    packets: Sequence[tuple[int, float]], words: Sequence[tuple[float, Sequence[int]]], sample_rate: int
) -> tuple[float, ...]:
    """How long after the packet holding a word's first sample its `words` event came, per word.

    `packets`: (sample just past the packet, arrival time) in order; `words`: (arrival time, the
    words' start_ms) per event. Negative: the word came first. Words whose audio never came are
    left out."""
    ends = [end for end, _ in packets]
    lags = []
    for arrived, starts in words:
        for start_ms in starts:
            index = bisect.bisect_right(ends, start_ms * sample_rate // 1000)
            if index < len(packets):
                lags.append(round(1000.0 * (arrived - packets[index][1]), 3))
    return tuple(lags)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def usd_per_m_chars(chars_per_s: float, price_per_hour: float = PRICE_PER_HOUR_USD) -> float | None:
    return 1e6 * price_per_hour / (3600.0 * chars_per_s) if chars_per_s > 0 else None


def summarize(
    concurrency: int,
    records: Sequence[RequestRecord],
    window: tuple[float, float],
    price_per_hour: float = PRICE_PER_HOUR_USD,
    gpu_mem_gb: float | None = None,
) -> dict[str, Any]:
    """One point: latency over requests sent inside the window, throughput over completions in it.
    TTFA and RTF count from admission; a request that waited in the server's queue reports its wait
    apart (`queue_wait_*`), one refused (overloaded) is counted apart from the errors."""
    start, end = window
    measured = [r for r in records if r.ended_at >= start]
    good = [r for r in measured if r.ok]
    refused = [r for r in measured if r.refused]
    queued = [r for r in good if r.queued]
    waits_ms = [1000.0 * r.queued_s for r in queued]
    answers_ms = [
        1000.0 * (r.answered_at - r.ended_at) for r in (*queued, *refused) if r.answered_at is not None
    ]
    completed = [
        r for r in records if r.ok and r.last_packet_at is not None and start <= r.last_packet_at <= end
    ]
    wall = max(end - start, 1e-9)
    chars_per_s = sum(r.chars for r in completed) / wall
    ttfa = [r.ttfa_ms for r in good]
    rtf = [r.rtf for r in good]
    first_underrun = [r.first_underrun_s for r in good if r.first_underrun_s is not None]
    stall_ms = [1000.0 * r.stall_s for r in good]
    lags = [lag for r in good for lag in r.word_lags_ms]
    return {
        "concurrency": concurrency,
        "requests": len(good),
        "errors": len(measured) - len(good) - len(refused),
        "admitted": len(good) - len(queued),  # admitted at once
        "queued": len(queued),  # admitted after a wait in the queue
        "refused": len(refused),
        "unfinished": sum(1 for r in measured if r.error == UNFINISHED),  # of the errors
        "queue_wait_p50_ms": _round(percentile(waits_ms, 50)),
        "queue_wait_p90_ms": _round(percentile(waits_ms, 90)),
        # the excess: from speak.end to its utterance.queued or its refusal
        "excess_answer_ms_p90": _round(percentile(answers_ms, 90)),
        "ttfa_p50_ms": _round(percentile(ttfa, 50)),
        "ttfa_p90_ms": _round(percentile(ttfa, 90)),
        "ttfa_p99_ms": _round(percentile(ttfa, 99)),
        "rtf_p50": _round(percentile(rtf, 50), 4),
        "rtf_p90": _round(percentile(rtf, 90), 4),
        "underrun_streams_pct": _round(100.0 * sum(r.underruns > 0 for r in good) / len(good))
        if good
        else None,
        "underrun_first_s_p50": _round(percentile(first_underrun, 50), 3),
        "underrun_in_first_s_pct": _round(
            100.0 * sum(t <= EARLY_UNDERRUN_S for t in first_underrun) / len(good)
        )
        if good
        else None,
        "stall_ms_p90": _round(percentile(stall_ms, 90)),
        "stall_ms_p99": _round(percentile(stall_ms, 99)),
        "words_timed": len(lags),
        "words_lag_ms_p50": _round(percentile(lags, 50)),
        "words_lag_ms_p90": _round(percentile(lags, 90)),
        "words_lag_ms_p99": _round(percentile(lags, 99)),
        "words_before_audio_pct": _round(100.0 * sum(lag <= 0 for lag in lags) / len(lags)) if lags else None,
        "chars_per_s": _round(chars_per_s),
        "audio_s_per_s": _round(sum(r.audio_s for r in completed) / wall, 3),  # goodput: admitted streams
        "usd_per_m_chars": _round(usd_per_m_chars(chars_per_s, price_per_hour), 4),
        "gpu_mem_gb": gpu_mem_gb,
        "window_s": _round(wall, 3),
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    if value is None or math.isnan(value):
        return None
    return round(value, digits)


def goodput_of_peak(points: Sequence[dict[str, Any]]) -> None:
    """Each point's audio-s/s (the admitted streams') as a share of the sweep's largest."""
    peak = max((p["audio_s_per_s"] or 0.0 for p in points), default=0.0)
    for p in points:
        p["goodput_pct_of_peak"] = _round(100.0 * (p["audio_s_per_s"] or 0.0) / peak, 1) if peak else None


def headline(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The largest C with p90 RTF < 1, p90 TTFA < 200 ms and no underrun in 99 % of streams."""
    passing = [
        p
        for p in points
        if p.get("rtf_p90") is not None
        and p["rtf_p90"] < REALTIME_RTF
        and p.get("ttfa_p90_ms") is not None
        and p["ttfa_p90_ms"] < HEADLINE_TTFA_MS
        and (p.get("underrun_streams_pct") or 0.0) <= HEADLINE_UNDERRUN_PCT
    ]
    if not passing:
        return {"concurrency": 0, "chars_per_s": 0, "usd_per_m_chars": None}
    best = max(passing, key=lambda p: p["concurrency"])
    out = {
        "concurrency": best["concurrency"],
        "chars_per_s": best["chars_per_s"],
        "usd_per_m_chars": best["usd_per_m_chars"],
    }
    # past the capacity, C counts the clients offered: the engine served `capacity` of them at once
    # and the rest waited (their TTFA and RTF count from admission)
    for name in ("capacity", "queued", "refused"):
        if name in best:
            out[name] = best[name]
    return out


def plot(points: Sequence[dict[str, Any]], stem: Path, title: str) -> list[Path]:
    """RTF and TTFA (p50 / p90) against C with the real-time line; $/M chars against C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [p["concurrency"] for p in points]

    def series(key: str) -> list[float]:
        return [math.nan if p[key] is None else p[key] for p in points]

    written: list[Path] = []
    fig, (ax_rtf, ax_ttfa) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_rtf.plot(cs, series("rtf_p50"), "o-", label="RTF p50")
    ax_rtf.plot(cs, series("rtf_p90"), "s-", label="RTF p90")
    ax_rtf.axhline(REALTIME_RTF, color="red", ls="--", lw=1, label="real time")
    ax_rtf.set(xlabel="concurrent streams", ylabel="RTF", title="real-time factor")
    ax_ttfa.plot(cs, series("ttfa_p50_ms"), "o-", label="TTFA p50")
    ax_ttfa.plot(cs, series("ttfa_p90_ms"), "s-", label="TTFA p90")
    ax_ttfa.axhline(HEADLINE_TTFA_MS, color="red", ls="--", lw=1, label=f"{HEADLINE_TTFA_MS:.0f} ms")
    ax_ttfa.set(xlabel="concurrent streams", ylabel="ms", title="time to first audio")
    for ax in (ax_rtf, ax_ttfa):
        if len(cs) > 1 and max(cs) / max(min(cs), 1) > 8:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = stem.with_name(stem.name + "_latency.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(cs, series("usd_per_m_chars"), "o-", color="green")
    ax.set(xlabel="concurrent streams", ylabel="$ per million characters", title="cost")
    if len(cs) > 1 and max(cs) / max(min(cs), 1) > 8:
        ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    fig.suptitle(title)
    fig.tight_layout()
    path = stem.with_name(stem.name + "_cost.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
