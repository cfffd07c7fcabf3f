"""The scheduler's host cost per step, in-process: Scheduler.schedule() + update() at N streams.

The real Scheduler (configured as `cadence serve` and bench/worker_host.py configure it)
is stepped synchronously against a stand-in runner that returns a frame for every sampling row and
the audio of every chunk in its own step, on a simulated clock (`--step-ms` per step), so the plans
depend only on the arguments: two trees step through the same plans, and `--digest` prints a hash
of every plan and every update() output to show it. Closed loop: each stream's request has
`--frames`-ish frames (varied per request so streams do not run in lockstep); a finished one is
replaced at once. Reported per level: the mean wall and thread CPU ms per step of schedule(),
update() and both, over the steps after `--warmup-steps`.

    .venv/bin/python -m bench.scheduler_step --streams 256,512 --steps 1200
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.api import TextSegment  # noqa: E402
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager  # noqa: E402
from engine.qwen3.plan import StepOutput, StepPlan  # noqa: E402
from engine.qwen3.request import Request, Segment  # noqa: E402
from engine.qwen3.scheduler import Scheduler, SchedulerConfig  # noqa: E402

PROMPT_LEN = 40
FRAME = (7,) * 16  # never the EOS code: segments end at their max_frames
AUDIO = object()  # the scheduler only passes a chunk's audio on


class SimClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Streams:
    """Closed-loop streams: a new request as soon as one finishes."""

    def __init__(self, scheduler: Scheduler, clock: SimClock, frames: int) -> None:
        self.scheduler, self.clock, self.frames = scheduler, clock, frames
        self.opened = 0

    def open(self) -> None:
        rid = f"r{self.opened}"
        frames = self.frames - 10 + (self.opened * 7) % 21
        self.opened += 1
        self.scheduler.add_request(Request(request_id=rid, arrival_time=self.clock()))
        segment = Segment(
            text=TextSegment("Hello there.", char_start=0), prompt_len=PROMPT_LEN, max_frames=frames
        )
        self.scheduler.add_segment(rid, segment)
        self.scheduler.close_text(rid)


def execute(plan: StepPlan) -> StepOutput:
    """The stand-in runner: a frame per sampling row, every chunk's audio in its own step."""
    audio = {c.request_id: AUDIO for c in plan.codec}
    audio |= {f.request_id: AUDIO for f in plan.first_audio_now}
    return StepOutput(codes=[FRAME] * len(plan.sampling_rows), audio=audio)


def plan_digest(plan: StepPlan, outs: list[Any]) -> bytes:
    rows = [
        repr(plan.decode),
        repr(plan.prefill),
        repr(plan.first_audio_now),
        plan.audio_in_flight,
        [(c.request_id, c.codec_slot, c.first_frame, len(c.codes), c.first_chunk) for c in plan.codec],
        plan.freed_kv_slots,
        plan.codec_resets,
        [
            (
                o.request_id,
                o.sample_offset,
                o.audio is not None,
                o.finished,
                o.status,
                len(o.finished_segments),
            )
            for o in outs
        ],
    ]
    return repr(rows).encode()


def level(streams: int, args: argparse.Namespace) -> dict[str, Any]:
    clock = SimClock()
    layout = KVCacheLayout(num_slots=streams, max_len=512, bytes_per_token=1024)
    config = SchedulerConfig(
        max_batch=streams,
        codec_slots=streams,
        max_codec_rows=streams,
        queue_limit=4 * streams,
        max_tokens_per_step=streams + 512,
    )
    scheduler = Scheduler(config, KVCacheManager(layout), clock=clock)
    load = Streams(scheduler, clock, args.frames)
    for _ in range(streams):
        load.open()
    digest = hashlib.sha256()
    totals = {"schedule": [0.0, 0.0], "update": [0.0, 0.0]}  # wall, CPU seconds
    step_s = args.step_ms / 1000
    gc.collect()
    for step in range(args.steps):
        measured = step >= args.warmup_steps
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = scheduler.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        output = execute(plan)
        clock.now += step_s
        t2, c2 = time.perf_counter(), time.thread_time()
        outs = scheduler.update(plan, output)
        t3, c3 = time.perf_counter(), time.thread_time()
        if measured:
            totals["schedule"][0] += t1 - t0
            totals["schedule"][1] += c1 - c0
            totals["update"][0] += t3 - t2
            totals["update"][1] += c3 - c2
        if args.digest:
            digest.update(plan_digest(plan, outs))
        for o in outs:
            if o.finished:
                load.open()
    n = max(1, args.steps - args.warmup_steps)
    ms = {
        f"{part}_{kind}ms": round(1000 * v[i] / n, 3)
        for part, v in totals.items()
        for i, kind in enumerate(("", "cpu_"))
    }
    row: dict[str, Any] = {
        "streams": streams,
        "steps": n,
        **ms,
        "host_ms_per_step": round(ms["schedule_ms"] + ms["update_ms"], 3),
        "host_cpu_ms_per_step": round(ms["schedule_cpu_ms"] + ms["update_cpu_ms"], 3),
        "requests": load.opened,
    }
    if args.digest:
        row["digest"] = digest.hexdigest()[:16]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="256,512")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--frames", type=int, default=60, help="frames per request, about (closed loop)")
    ap.add_argument("--step-ms", type=float, default=30.0, help="simulated time per step")
    ap.add_argument(
        "--gc-threshold", type=int, default=7000, help="young-generation GC threshold (as the worker)"
    )
    ap.add_argument("--digest", action="store_true", help="hash every plan and output (slower)")
    args = ap.parse_args()
    gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    for n in args.streams.split(","):
        print(json.dumps(level(int(n), args)), flush=True)


if __name__ == "__main__":
    main()
