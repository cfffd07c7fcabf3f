"""Sync mode's release of audio, simulated without a model or a clock: what the probes' rules cost in
first audio and whether the listener keeps playing.

The real `AlignmentTracker` receives one utterance's audio as the Qwen3 engine makes it (chunks of
80 ms frames growing 1, 2, 4, ... up to `--largest`, 8 by default as the engine makes sync streams'
(engine.alignment.engine.SYNC_SCHEDULE), 25 as it makes the others', at `--speed` times real time)
and its jobs are answered
`--latency-ms` after they are asked, with the words a trained aligner would give: each unit at the
benchmark's speech rate (engine.alignment.forced_times), units past the window's audio at its end.
The engine's own words come with the segment's last chunk, as the Qwen3 engine's estimates do.

Per case: the added time to first audio (the first release against the first frame made), and the
listener's playback from the first release with a `--buffer-ms` jitter buffer: how late the latest
sample came against its playback time (above zero: the listener ran dry), and the releases. Cases
are the product of `--largest`, `--speed`, `--latency-ms` and the corpus's English prompts
(`--prompts`), each one segment, as the gateway sends a prompt that holds no clause break within its
first words.

    .venv/bin/python -m bench.sync_release_sim --largest 25,8 --speed 2,3,4 --latency-ms 30,60,120
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aligner.text import UnitSplitter, display_spans  # noqa: E402
from engine.alignment.api import AlignedWord  # noqa: E402
from engine.alignment.engine import SYNC_SCHEDULE  # noqa: E402
from engine.alignment.forced_times import forced_words, speech_offsets  # noqa: E402
from engine.alignment.track import AlignJob, AlignmentTracker  # noqa: E402
from engine.api import AudioChunk, ChunkSchedule, TextSegment, WordTiming  # noqa: E402
from engine.qwen3.scheduler import chunk_frames  # noqa: E402

RATE = 24_000
FRAME = RATE * 80 // 1000
SPLITTER = UnitSplitter()


def trained(job: AlignJob) -> tuple[WordTiming, ...]:
    """The words of a trained aligner at the benchmark's speech rate, on the job's timeline."""
    spans = display_spans(job.text, SPLITTER.units(job.text, job.language))
    units = [AlignedWord(job.text[a:b], 0.0, 0.0, a, b) for a, b in spans]
    return job.words_from(forced_words(units, job.text, job.audio_s))


def estimates(text: str) -> tuple[WordTiming, ...]:
    """The engine's own word estimates over the whole segment (they come with its end)."""
    offsets = speech_offsets(text)
    spans = display_spans(text, SPLITTER.units(text, "English"))
    return tuple(
        WordTiming(text[a:b], int(offsets[a] * RATE), int(offsets[b] * RATE), a, b, "estimate")
        for a, b in spans
    )


def simulate(
    text: str, speed: float, latency_s: float, buffer_s: float, schedule: ChunkSchedule = SYNC_SCHEDULE
) -> dict[str, Any]:
    frames = max(1, round(speech_offsets(text)[-1] / 0.08))  # the corpus's forced length
    tracker = AlignmentTracker("r", "English", RATE, max_window_s=400.0, mode="sync")
    tracker.push(TextSegment(text, 0))
    events: list[tuple[float, int, str, Any]] = []  # (time, order, kind, payload)
    made, k, order = 0, 0, 0
    while made < frames:  # the engine's chunks, at `speed` times real time
        n = min(chunk_frames(schedule, k), frames - made)
        made += n
        k += 1
        heapq.heappush(events, (made * 0.08 / speed, order, "chunk", made))
        order += 1
    first_frame_s = 0.08 / speed
    releases: list[tuple[float, int, int]] = []  # (time, first sample, samples)
    audio = np.zeros(frames * FRAME, np.float32)
    sent = 0
    jobs = 0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "chunk":
            end = payload * FRAME
            final = payload == frames
            chunk = AudioChunk("r", audio[sent:end], sent, estimates(text) if final else (), final)
            sent = end
            out, new_jobs = tracker.on_chunk(chunk)
            for job in new_jobs:
                jobs += 1
                heapq.heappush(events, (now + latency_s, order, "answer", job))
                order += 1
        else:
            out = tracker.on_aligned(payload, trained(payload))
        for c in out:
            if len(c.samples):
                releases.append((now, c.sample_offset, len(c.samples)))
    assert sum(n for _, _, n in releases) == len(audio), "every sample released once"
    start = releases[0][0]
    # sample s plays at start + buffer + s / RATE: each release's first sample against its time
    lateness = max(t - (start + buffer_s + offset / RATE) for t, offset, _ in releases)
    return {
        "chars": len(text),
        "audio_s": round(frames * 0.08, 2),
        "added_ttfa_ms": round(1000 * (start - first_frame_s), 1),
        "latest_ms": round(1000 * lateness, 1),
        "ran_dry": lateness > 0,
        "releases": len(releases),
        "jobs": jobs,
    }


def prompts(corpus: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in corpus.read_text().splitlines() if line.strip()]
    return [r["text"] for r in rows if r.get("language") == "en"][:count]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--largest",
        default=str(SYNC_SCHEDULE.largest),
        help="the chunks' largest size in frames, comma-separated",
    )
    ap.add_argument("--speed", default="2,3,4", help="audio made per second of wall time, comma-separated")
    ap.add_argument(
        "--latency-ms", default="30,60,120", help="an alignment job's answer time, comma-separated"
    )
    ap.add_argument("--buffer-ms", type=float, default=150.0, help="the listener's jitter buffer")
    ap.add_argument("--prompts", type=int, default=20, help="English prompts of the corpus, from the first")
    ap.add_argument("--corpus", type=Path, default=ROOT / "deploy" / "bench" / "corpus.jsonl")
    ap.add_argument("-o", "--out", type=Path, default=None)
    args = ap.parse_args(argv)
    texts = prompts(args.corpus, args.prompts)
    results = []
    grid = [
        (int(largest), float(speed), float(latency))
        for largest in args.largest.split(",")
        for speed in args.speed.split(",")
        for latency in args.latency_ms.split(",")
    ]
    for largest, speed, latency in grid:
        schedule = ChunkSchedule(largest=largest)
        cases = [simulate(t, speed, latency / 1000, args.buffer_ms / 1000, schedule) for t in texts]
        summary = {
            "largest": largest,
            "speed": speed,
            "latency_ms": latency,
            "prompts": len(cases),
            "added_ttfa_ms_p50": statistics.median(c["added_ttfa_ms"] for c in cases),
            "added_ttfa_ms_max": max(c["added_ttfa_ms"] for c in cases),
            "ran_dry_pct": round(100 * sum(c["ran_dry"] for c in cases) / len(cases), 1),
            "latest_ms_max": max(c["latest_ms"] for c in cases),
            "releases_p50": statistics.median(c["releases"] for c in cases),
            "jobs_p50": statistics.median(c["jobs"] for c in cases),
        }
        results.append(summary)
        print(json.dumps(summary))
    if args.out is not None:
        command = " ".join(["python -m bench.sync_release_sim", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(json.dumps({"command": command, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
