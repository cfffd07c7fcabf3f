"""The engine at load, simulated on the CPU: the real scheduler against a GPU cost model.

The real Scheduler (torch-free) plans every step. A cost model turns each plan into GPU time, the
way the runner executes it on one CUDA stream: the talker decode graph (decode rows and one-position
prompt chunks), longer prompt chunks, sampling + the code predictor, and Code2Wav launches, one per
(frames, 64-row slice) group padded to its batch bucket, first chunks collected in the step, later
ones a step after (the deferring runner). The clock moves by that GPU time plus the host work the
GPU does not overlap (`--host-ms`, and `--host-us-per-row` for each sampling row past
`--host-rows-overlapped`). Closed-loop streams take the corpus's forced lengths; each listener is
the load test's PlaybackClock (150 ms buffer), so TTFA, RTF and underruns mean what `cadence bench`
reports, at the engine's edge (no gateway, no network). Step figures are means over the measured
window (after `--warmup`).

The cost model defaults to the H200 figures of deploy/bench (`--preset`, or `--costs` JSON with
Costs' fields): Code2Wav per (rows, frames) from every graph shape the engine replays
(`h200-codec-shapes.json`, written by `scripts/gpu_session.sh 6`), interpolated, times
`--codec-scale 1.06`; talker decode and sampling per row, and the host term, per preset:

- `h200-fused-layers` (default): decode and sampling fitted to the stage figures of the sweep with
  fused decoder layers (`h200-e2e-1.7b-fused-layers.json`, C=256-512: decode 3.3-6.3 ms, sampling
  6.7-9.6 ms for 247-501 rows), the host term to its step: the simulated step 31 / 46 / 62 ms at
  C=256 / 384 / 512 (measured 30 / 47 / 61), RTF p50 0.40 / 0.58 / 0.78 (0.41 / 0.59 / 0.72). The
  simulated Code2Wav is 15-35 % above that run's replay time and the host term (0 / 5 / 10 ms)
  below its GPU gaps (4 / 15 / 21 ms); the step, which sets TTFA and the listeners' lead, is what
  matches.
- `h200-eager-layers`: the sixth session's sweep (unfused layers), host 5 ms a step. With that
  sweep's scheduler (`--set max_now_frame_rows=0`) it gives RTF p50 0.79 and a 63 ms step at C=512
  (measured 0.78) and, with the delivery delay below, its streams with an underrun (2.4 / 6.9 / 22 %
  at C=256 / 384 / 512; measured 3.5 / 6.4 / 19 %, most of them in the first second of audio).

Underruns come out far lower than measured without a delivery delay (no gateway, network or GPU
jitter here), so compare them between policies, not with a GPU run; `--delivery-base-ms 20
--delivery-jitter-ms 30` (exponential, per delivery) is the delay fitted to the sixth session's
underruns. `--gateway-us-per-packet` models the gateway sending a step's audio one stream after
another instead. `--seed` varies arrivals, lengths and jitter.

    .venv/bin/python -m scripts.sim_engine --streams 256,384,512 --seconds 30
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.client import PlaybackClock  # noqa: E402
from clients.loadtest_report import EARLY_UNDERRUN_S  # noqa: E402
from engine.api import TextSegment  # noqa: E402
from engine.cuda_graphs import batch_buckets, bucket_for  # noqa: E402
from engine.kv_cache import KVCacheLayout, KVCacheManager  # noqa: E402
from engine.plan import StepOutput  # noqa: E402
from engine.request import SAMPLE_RATE, SAMPLES_PER_FRAME, Request, Segment  # noqa: E402
from engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402

CODEC_BATCH = 64
PACKET_SAMPLES = 480  # 20 ms at 24 kHz
CODEC_SHAPES = ROOT / "deploy/bench/h200-codec-shapes.json"  # H200, bf16: Code2Wav graph ms per shape


@dataclass
class Costs:
    """GPU milliseconds of each part of a step, and the host time the GPU waits for."""

    decode: tuple[float, float] = (0.43, 0.01155)  # ms = a + b * rows (talker decode graph)
    sample: tuple[float, float] = (4.06, 0.01129)  # sampling + the 15-step code predictor
    prefill_per_chunk: float = 1.0  # a longer prompt chunk's share of its graph
    codec: dict[int, dict[int, float]] = field(default_factory=dict)  # rows -> frames -> ms
    # host work per step the GPU does not overlap: host_ms, plus host_us_per_row for each sampling
    # row past host_rows_overlapped (below that many rows the host keeps up with the GPU)
    host_ms: float = 0.0
    host_us_per_row: float = 40.0
    host_rows_overlapped: int = 260

    def codec_ms(self, rows: int, frames: int) -> float:
        table = self.codec
        row_keys = sorted(table)
        lo = max([r for r in row_keys if r <= rows], default=row_keys[0])
        hi = min([r for r in row_keys if r >= rows], default=row_keys[-1])
        a, b = _by_frames(table[lo], frames), _by_frames(table[hi], frames)
        return a if hi == lo else a + (b - a) * (rows - lo) / (hi - lo)

    def host_step_ms(self, rows: int) -> float:
        return self.host_ms + self.host_us_per_row / 1000 * max(0, rows - self.host_rows_overlapped)


# talker and sampling costs and the host term of each calibration (see the module's docstring)
PRESETS: dict[str, dict[str, Any]] = {
    "h200-fused-layers": {},  # the defaults
    "h200-eager-layers": {"decode": (1.0, 0.0125), "sample": (6.7, 0.0167),
                          "host_ms": 5.0, "host_us_per_row": 0.0, "host_rows_overlapped": 0},
}


def _by_frames(row: dict[int, float], frames: int) -> float:
    keys = sorted(row)
    i = bisect.bisect_left(keys, frames)
    if i < len(keys) and keys[i] == frames:
        return row[frames]
    lo, hi = keys[max(0, i - 1)], keys[min(len(keys) - 1, i)]
    return row[lo] if hi == lo else row[lo] + (row[hi] - row[lo]) * (frames - lo) / (hi - lo)


def load_costs(path: Path | None, codec_shapes: Path | None = None, preset: str = "h200-fused-layers") -> Costs:
    """A preset's costs, or a JSON cost model (Costs' fields; the host ones optional);
    `codec_shapes` (scripts/gpu_codec_bench.py --json) replaces the Code2Wav table."""
    if path is not None:
        data = json.loads(path.read_text())
        host = {k: data[k] for k in ("host_ms", "host_us_per_row", "host_rows_overlapped") if k in data}
        return Costs(tuple(data["decode"]), tuple(data["sample"]), data["prefill_per_chunk"],
                     {int(r): {int(f): ms for f, ms in v.items()} for r, v in data["codec"].items()}, **host)
    table: dict[int, dict[int, float]] = defaultdict(dict)
    for row in json.loads((codec_shapes or CODEC_SHAPES).read_text()):
        table[int(row["batch"])][int(row["frames"])] = float(row["graph_ms"])
    return Costs(codec=dict(table), **PRESETS[preset])


def codec_launches(chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(rows, frames) of each Code2Wav launch for chunks of (frames,) as the runner groups them."""
    by_frames: dict[int, int] = defaultdict(int)
    for frames, _ in chunks:
        by_frames[frames] += 1
    buckets = batch_buckets(CODEC_BATCH)
    out = []
    for frames, rows in by_frames.items():
        while rows > 0:
            part = min(rows, CODEC_BATCH)
            out.append((bucket_for(part, buckets) or part, frames))
            rows -= part
    return out


class Simulation:
    def __init__(self, args: argparse.Namespace, streams: int, costs: Costs) -> None:
        self.args, self.costs, self.now = args, costs, 0.0
        layout = KVCacheLayout(num_slots=streams, max_len=512, bytes_per_token=1024)
        config = SchedulerConfig(max_batch=streams, codec_slots=streams, max_codec_rows=streams,
                                 queue_limit=streams, max_tokens_per_step=streams + 512, codec_delivery_steps=1)
        if args.merge_below is not None:
            config.merge_codec_groups_below = args.merge_below
        if args.smooth is not None:
            config.codec_frames_over_production = args.smooth
        try:
            config.override(args.set or [])  # --set urgent_codec_chunks=true
        except ValueError as e:
            raise SystemExit(f"--set: {e}") from e
        self.sched = Scheduler(config, KVCacheManager(layout), clock=lambda: self.now)
        self.rng = random.Random(args.seed)
        rows = [json.loads(line) for line in (ROOT / "deploy/bench/corpus.jsonl").read_text().splitlines()]
        self.lengths = [int(r["frames"]) for r in rows if r.get("frames")]
        self.players: dict[str, tuple[PlaybackClock, float, int]] = {}  # id -> (player, opened, frames)
        self.arrived: dict[str, float] = {}  # the last delivery's arrival per stream
        self.burst_s = 0.0
        self.deferred: list[tuple[str, int]] = []  # later chunks: delivered at the next step's end
        self.done: list[dict[str, float]] = []
        self.launches = self.steps = 0
        self.gpu_ms: dict[str, float] = defaultdict(float)
        self.host_ms = 0.0
        self.rows = 0  # sampling rows over the measured window
        self.step_ms = 0.0
        self.ids = 0
        # the first streams come over `ramp_s` (as the load test connects them), then each that
        # ends is replaced at once (closed loop)
        self.starts = sorted(self.rng.uniform(0, args.ramp_s) for _ in range(streams))

    def open(self) -> None:
        rid = f"r{self.ids}"
        self.ids += 1
        frames = self.rng.choice(self.lengths)
        r = Request(request_id=rid, arrival_time=self.now)
        r.segments.append(Segment(text=TextSegment("x", char_start=0), prompt_len=self.args.prompt, max_frames=frames))
        r.text_closed = True
        self.sched.add_request(r)
        self.players[rid] = (PlaybackClock(SAMPLE_RATE, self.args.buffer_ms, clock=lambda: self.now), self.now, frames)

    def step(self) -> None:
        while self.starts and self.starts[0] <= self.now:
            self.starts.pop(0)
            self.open()
        if not self.sched.has_work():  # nothing yet: time passes to the next arrival
            self.now = max(self.now, self.starts[0]) if self.starts else self.now + 0.001
            return
        plan = self.sched.schedule()
        decode_rows = len(plan.decode) + sum(1 for c in plan.prefill if c.length == 1)
        longer = sum(1 for c in plan.prefill if c.length > 1)
        ms = {"decode": self.costs.decode[0] + self.costs.decode[1] * decode_rows if decode_rows else 0.0,
              "prefill": self.costs.prefill_per_chunk * longer}
        sampled = len(plan.sampling_rows)
        ms["sample"] = self.costs.sample[0] + self.costs.sample[1] * sampled if sampled else 0.0
        now_chunks = [(c.num_frames, 0) for c in plan.codec if c.first_chunk or c.urgent]
        now_chunks += [(1, 0)] * len(plan.first_audio_now)
        later_chunks = [(c.num_frames, 0) for c in plan.codec if not (c.first_chunk or c.urgent)]
        now_launches, later_launches = codec_launches(now_chunks), codec_launches(later_chunks)
        ms["codec_now"], ms["codec_later"] = self._codec_ms(now_launches), self._codec_ms(later_launches)
        host_ms = self.costs.host_step_ms(sampled)
        step_ms = sum(ms.values()) + host_ms
        if self.now >= self.args.warmup:  # the step's figures: over the measured window only
            self.launches += len(now_launches) + len(later_launches)
            for k, v in ms.items():
                self.gpu_ms[k] += v
            self.host_ms += host_ms
            self.steps += 1
            self.rows += sampled
            self.step_ms += step_ms
        self.now += step_ms / 1000
        # this step's first chunks arrive now; the previous step's later chunks too
        delivered = [(c.request_id, c.num_frames) for c in plan.codec if c.first_chunk or c.urgent]
        delivered += [(f.request_id, 1) for f in plan.first_audio_now]
        delivered += self.deferred
        self.deferred = [(c.request_id, c.num_frames) for c in plan.codec if not (c.first_chunk or c.urgent)]
        codes = [[7] * 16 for _ in plan.sampling_rows]
        frames: dict[str, int] = defaultdict(int)
        for rid, n in delivered:
            frames[rid] += n
        audio = {rid: _silence(n) for rid, n in frames.items()}
        self.burst_s = 0.0  # the gateway sends a step's audio one stream after another
        for out in self.sched.update(plan, StepOutput(codes=codes, audio=audio, delivered=delivered)):
            if out.audio is not None:
                self.burst_s += len(out.audio) / PACKET_SAMPLES * self.args.gateway_us_per_packet / 1e6
                self.deliver(out.request_id, len(out.audio))
            if out.finished:
                self.finish(out.request_id)

    def _codec_ms(self, launches: list[tuple[int, int]]) -> float:
        return self.args.codec_scale * sum(self.costs.codec_ms(rows, frames) for rows, frames in launches)

    def deliver(self, rid: str, samples: int) -> None:
        """Audio reaches the listener after the gateway's and the network's delay, in order."""
        at = self.now + self.burst_s + self.args.delivery_base_ms / 1000
        if self.args.delivery_jitter_ms > 0:
            at += self.rng.expovariate(1000 / self.args.delivery_jitter_ms)
        at = max(at, self.arrived.get(rid, 0.0))
        self.arrived[rid] = at
        self.players[rid][0].on_packet(samples, at)

    def finish(self, rid: str) -> None:
        player, opened, frames = self.players.pop(rid)
        self.arrived.pop(rid, None)
        if player.first_packet_at is not None and self.now > self.args.warmup:
            audio_s = frames * SAMPLES_PER_FRAME / SAMPLE_RATE
            self.done.append({"ttfa": player.first_packet_at - opened, "rtf": (self.now - opened) / audio_s,
                              "underrun": float(player.underruns > 0), "audio_s": audio_s,
                              "early": float(player.first_underrun_s is not None and player.first_underrun_s <= EARLY_UNDERRUN_S)})
        self.open()

    def run(self) -> dict[str, Any]:
        while self.now < self.args.warmup + self.args.seconds:
            self.step()
        d = self.done
        window = self.args.seconds
        return {
            "streams": len(self.players), "requests": len(d),
            "ttfa_p50_ms": round(1000 * _pct([x["ttfa"] for x in d], 50), 1),
            "ttfa_p90_ms": round(1000 * _pct([x["ttfa"] for x in d], 90), 1),
            "ttfa_p99_ms": round(1000 * _pct([x["ttfa"] for x in d], 99), 1),
            "rtf_p50": round(_pct([x["rtf"] for x in d], 50), 3), "rtf_p90": round(_pct([x["rtf"] for x in d], 90), 3),
            "underrun_streams_pct": round(100 * statistics.fmean(x["underrun"] for x in d), 1) if d else None,
            "underrun_in_first_s_pct": round(100 * statistics.fmean(x["early"] for x in d), 1) if d else None,
            "audio_s_per_s": round(sum(x["audio_s"] for x in d) / window, 1),
            "step_ms": round(self.step_ms / max(1, self.steps), 2),
            "rows_per_step": round(self.rows / max(1, self.steps), 1),
            "codec_launches_per_step": round(self.launches / max(1, self.steps), 2),
            **{f"gpu_ms_{k}": round(v / max(1, self.steps), 2) for k, v in self.gpu_ms.items()},
            "host_ms": round(self.host_ms / max(1, self.steps), 2),
        }


def _silence(frames: int) -> Any:
    return range(frames * SAMPLES_PER_FRAME)  # only its length is read


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="256,384,512")
    ap.add_argument("--seconds", type=float, default=30.0, help="simulated seconds measured per level")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--ramp-s", type=float, default=2.0, help="the first streams arrive over this")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200-fused-layers",
                    help="talker, sampling and host costs of a calibration (see above)")
    ap.add_argument("--host-ms", type=float, default=None, help="host work per step the GPU does not overlap")
    ap.add_argument("--host-us-per-row", type=float, default=None,
                    help="host work per sampling row past --host-rows-overlapped the GPU does not overlap")
    ap.add_argument("--host-rows-overlapped", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="arrivals, lengths and delivery jitter")
    ap.add_argument("--codec-scale", type=float, default=1.06,
                    help="Code2Wav time in the engine over the isolated bench's (calibrated, see above)")
    ap.add_argument("--prompt", type=int, default=1, help="prompt positions left after the prefix cache")
    ap.add_argument("--buffer-ms", type=float, default=150.0)
    ap.add_argument("--delivery-base-ms", type=float, default=0.0, help="engine to listener, fixed part")
    ap.add_argument("--gateway-us-per-packet", type=float, default=0.0,
                    help="the gateway's time per 20 ms packet: a step's audio leaves in the order of its outputs")
    ap.add_argument("--delivery-jitter-ms", type=float, default=0.0,
                    help="engine to listener, mean of an exponential extra delay per delivery")
    ap.add_argument("--merge-below", type=int, default=None, help="the scheduler's merge_codec_groups_below")
    ap.add_argument("--smooth", type=float, default=None, help="the scheduler's codec_frames_over_production")
    ap.add_argument("--set", action="append", metavar="FIELD=JSON",
                    help="a SchedulerConfig field, e.g. --set max_early_codec_rows=64 (repeatable)")
    ap.add_argument("--costs", type=Path, default=None, help="a cost model as JSON (see Costs)")
    ap.add_argument("--codec-shapes", type=Path, default=None, help="scripts/gpu_codec_bench.py --json output")
    args = ap.parse_args()
    costs = load_costs(args.costs, args.codec_shapes, args.preset)
    for name in ("host_ms", "host_us_per_row", "host_rows_overlapped"):
        if getattr(args, name) is not None:
            setattr(costs, name, getattr(args, name))
    for n in args.streams.split(","):
        print(json.dumps(Simulation(args, int(n), costs).run()))


if __name__ == "__main__":
    main()
