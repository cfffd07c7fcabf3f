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

The cost model (`--preset`, or `--costs` JSON with Costs' fields) comes from H200 measurements in
deploy/bench: Code2Wav per (rows, frames) from every graph shape the engine replays
(`h200-codec-shapes.json`, `bench/gpu_session.sh codec`), interpolated, times the preset's `codec_scale`
(`--codec-scale`) and, where a preset names one, a newer Code2Wav's ratio to that table on fewer
shapes; talker decode and sampling per row, and the host term, per preset:

- `current` (default): the current build's parts as measured alone, not fitted to a sweep: Code2Wav
  from `h100-codec.json` (the current Code2Wav on an H100, within 3 % of the H200 at every bucket),
  talker decode and sampling as `h200-batched-prompts`, no host term; its step comes out shorter
  than the sweep's (`h200-e2e-1.7b.json`: 38.5 ms at 512 streams, simulated 35.2), which measures
  the gaps and prompt chunks too, so compare policies under it, not absolute figures.
- `h200-batched-prompts`: fitted to the stage figures of the sweep with each step's
  prompts built in one batch at its start (`h200-e2e-1.7b-batched-prompts.json`); Code2Wav with
  the fused pre-transformer (`h200-codec-fused-transformer.json`); no host term, since the GPU's
  gaps between stages about cancel the first-chunk lane's Code2Wav, which overlaps the step.
- `h200-fused-layers`: fitted to the sweep with fused decoder layers
  (`h200-e2e-1.7b-fused-layers.json`), the host term fitted to its step.
- `h200-eager-layers`: fitted to a sweep with the decoder layers on eager ops, a fixed host term.

Each preset is fitted so that the simulated step, which sets TTFA and the listeners' lead, matches
the measured one; the parts of it (Code2Wav, the host's share) may differ.

Underruns come out far lower than measured without a delivery delay (no gateway, network or GPU
jitter here), so compare them between policies, not with a GPU run. Delays after the engine:
`--delivery-base-ms` and `--delivery-jitter-ms` (exponential, per delivery);
`--gateway-us-per-packet`, the gateway sending each step's audio one stream after another, in the
runner's order, behind what it had left; `--stall-ms` / `--stalls-per-s`, pauses of everything after
the engine. `--request-ms`: a closed-loop client's next request reaches the engine this long after
it is sent (when the last audio of the one before reached it), so requests arrive inside steps as
on a GPU; TTFA and RTF count from the send. `--schedule` sets the requests' chunk schedule;
`--explain` prints which delivery came late at each stream's first underrun and the engine's lead
per delivery. `--seed` varies arrivals, lengths, jitter and stalls.

Admission: the scheduler admits by the step cost it measures (engine.qwen3.capacity), so the
simulated engine finds its own capacity. `--slots` sets its upper bound (talker slots, Code2Wav
rows, the decode batch: what the KV budget holds; default the level) and `--queue-limit` the
requests waiting beyond it; offer more streams than it keeps in real time and the excess waits
in the queue, or is refused and comes back after its Retry-After, as a client would. TTFA and RTF
count from a request's admission (its send when it was admitted at once); `queue_wait_*` is the
time queued requests waited; `capacity` is what the measured cost admitted at the end.

    .venv/bin/python -m bench.sim_engine --streams 256,384,512 --seconds 30
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import random
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.client import PlaybackClock  # noqa: E402
from clients.loadtest_report import EARLY_UNDERRUN_S  # noqa: E402
from engine.api import ChunkSchedule, Overloaded, TextSegment  # noqa: E402
from engine.qwen3.cuda_graphs import batch_buckets, bucket_for  # noqa: E402
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager  # noqa: E402
from engine.qwen3.plan import StepOutput  # noqa: E402
from engine.qwen3.request import SAMPLE_RATE, SAMPLES_PER_FRAME, Request, Segment  # noqa: E402
from engine.qwen3.scheduler import Scheduler, SchedulerConfig  # noqa: E402

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
    # a newer Code2Wav's time over the table's, rows -> frames -> ratio, on fewer shapes than the
    # table (interpolated like it); empty: none
    codec_speedup: dict[int, dict[int, float]] = field(default_factory=dict)
    codec_scale: float = 1.06  # Code2Wav in the engine over the isolated bench (fitted per preset)

    def codec_ms(self, rows: int, frames: int) -> float:
        """The table's (the isolated bench's) Code2Wav time of one launch."""
        return _interpolate(self.codec, rows, frames)

    def launch_ms(self, rows: int, frames: int) -> float:
        """One Code2Wav launch as the simulation charges it: the table's time times the ratio."""
        ms = self.codec_scale * self.codec_ms(rows, frames)
        return ms * _interpolate(self.codec_speedup, rows, frames) if self.codec_speedup else ms

    def host_step_ms(self, rows: int) -> float:
        return self.host_ms + self.host_us_per_row / 1000 * max(0, rows - self.host_rows_overlapped)


# the batched-prompts sweep's talker and sampling, no host term
_BATCHED_PROMPTS: dict[str, Any] = {
    "decode": (2.21, 0.00595),
    "sample": (3.68, 0.01158),
    "codec_scale": 1.0,
    "host_ms": 0.0,
    "host_us_per_row": 0.0,
    "host_rows_overlapped": 0,
}
# talker and sampling costs and the host term of each calibration (see the module's docstring);
# `codec_table`: the Code2Wav table in place of h200-codec-shapes.json; `codec_since`: a
# bench/gpu_codec_bench.py --json file of a newer Code2Wav, on fewer shapes than
# the table, whose ratio to the table is Costs.codec_speedup
PRESETS: dict[str, dict[str, Any]] = {
    "current": {**_BATCHED_PROMPTS, "codec_table": "deploy/bench/h100-codec.json"},
    "h200-batched-prompts": {
        **_BATCHED_PROMPTS,
        "codec_since": "deploy/bench/h200-codec-fused-transformer.json",
    },
    "h200-fused-layers": {},  # the Costs defaults
    "h200-eager-layers": {
        "decode": (1.0, 0.0125),
        "sample": (6.7, 0.0167),
        "host_ms": 5.0,
        "host_us_per_row": 0.0,
        "host_rows_overlapped": 0,
    },
}
DEFAULT_PRESET = "current"


def _interpolate(table: dict[int, dict[int, float]], rows: int, frames: int) -> float:
    row_keys = sorted(table)
    lo = max([r for r in row_keys if r <= rows], default=row_keys[0])
    hi = min([r for r in row_keys if r >= rows], default=row_keys[-1])
    a, b = _by_frames(table[lo], frames), _by_frames(table[hi], frames)
    return a if hi == lo else a + (b - a) * (rows - lo) / (hi - lo)


def _by_frames(row: dict[int, float], frames: int) -> float:
    keys = sorted(row)
    i = bisect.bisect_left(keys, frames)
    if i < len(keys) and keys[i] == frames:
        return row[frames]
    lo, hi = keys[max(0, i - 1)], keys[min(len(keys) - 1, i)]
    return row[lo] if hi == lo else row[lo] + (row[hi] - row[lo]) * (frames - lo) / (hi - lo)


def load_costs(path: Path | None, codec_shapes: Path | None = None, preset: str = DEFAULT_PRESET) -> Costs:
    """A preset's costs, or a JSON cost model (Costs' fields; the host ones optional);
    `codec_shapes` (bench/gpu_codec_bench.py --json) replaces the Code2Wav table."""
    if path is not None:
        data = json.loads(path.read_text())
        host = {k: data[k] for k in ("host_ms", "host_us_per_row", "host_rows_overlapped") if k in data}
        return Costs(
            tuple(data["decode"]),
            tuple(data["sample"]),
            data["prefill_per_chunk"],
            {int(r): {int(f): ms for f, ms in v.items()} for r, v in data["codec"].items()},
            **host,
        )
    fields = dict(PRESETS[preset])
    own = fields.pop("codec_table", None)
    table = _codec_table(codec_shapes or (ROOT / own if own else CODEC_SHAPES))
    since = fields.pop("codec_since", None)
    if since is not None:
        base = Costs(codec=table)
        fields["codec_speedup"] = {
            rows: {f: ms / base.codec_ms(rows, f) for f, ms in by_frames.items()}
            for rows, by_frames in _codec_table(ROOT / since).items()
        }
    return Costs(codec=table, **fields)


def _codec_table(path: Path) -> dict[int, dict[int, float]]:
    table: dict[int, dict[int, float]] = defaultdict(dict)
    data = json.loads(path.read_text())
    for row in data["rows"] if isinstance(data, dict) else data:  # a run record keeps them under "rows"
        table[int(row["batch"])][int(row["frames"])] = float(row["graph_ms"])
    return dict(table)


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
        self.args, self.costs, self.now, self.level = args, costs, 0.0, streams
        slots = getattr(args, "slots", None) or streams
        queue_limit = getattr(args, "queue_limit", None)
        layout = KVCacheLayout(num_slots=slots, max_len=512, bytes_per_token=1024)
        config = SchedulerConfig(
            max_batch=slots,
            codec_slots=slots,
            max_codec_rows=slots,
            queue_limit=slots if queue_limit is None else queue_limit,
            max_tokens_per_step=slots + 512,
        )
        if args.merge_below is not None:
            config.merge_codec_groups_below = args.merge_below
        if args.smooth is not None:
            config.codec_frames_over_production = args.smooth
        try:
            config.override(args.set or [])  # --set max_early_codec_rows=96
        except ValueError as e:
            raise SystemExit(f"--set: {e}") from e
        self.sched = Scheduler(config, KVCacheManager(layout), clock=lambda: self.now, codec_delivery_steps=1)
        self.schedule = _chunk_schedule(getattr(args, "schedule", None))
        self.request_s = getattr(args, "request_ms", 0.0) / 1000
        rate = getattr(args, "stalls_per_s", 0.0)
        self.stall_s = getattr(args, "stall_ms", 0.0) / 1000 if rate > 0 else 0.0
        self.stall_rng = random.Random(f"stalls{args.seed}")  # its own: the same stalls whatever the policy
        self.stalls = [self.stall_rng.expovariate(rate)] if self.stall_s else []  # start times, in order
        self.rng = random.Random(args.seed)
        rows = [json.loads(line) for line in (ROOT / "deploy/bench/corpus.jsonl").read_text().splitlines()]
        self.lengths = [int(r["frames"]) for r in rows if r.get("frames")]
        # id -> (player, from: its send or its admission, frames, its admission ticket)
        self.players: dict[str, tuple[PlaybackClock, float, int, Any]] = {}
        self.queued = self.refused = self.offered = 0  # over the measured window
        self.waits: list[float] = []  # queued requests' waits, admitted in the measured window
        self.max_admitted = self.max_queued = 0  # over the whole run
        self.arrived: dict[str, float] = {}  # the last delivery's arrival per stream
        self.gateway_free = 0.0  # when the gateway has sent all the audio it was given
        self.deferred: list[tuple[str, int]] = []  # later chunks: delivered at the next step's end
        self.done: list[dict[str, Any]] = []
        self.late: list[
            dict[str, Any]
        ] = []  # each measured stream's first underrun: the delivery that came late
        self.delivery: dict[
            str, tuple[int, str, int, float]
        ] = {}  # this step's: rid -> (chunk, kind, frames, lead)
        self.chunks: dict[str, int] = defaultdict(int)  # deliveries so far per stream
        self.leads_by_chunk: dict[int, list[float]] = defaultdict(
            list
        )  # the engine's lead per delivery index
        self.kinds_by_chunk: dict[int, Counter[str]] = defaultdict(Counter)
        self.launches = self.steps = self.codec_rows = self.codec_frames = self.now_frames = 0
        self.gpu_ms: dict[str, float] = defaultdict(float)
        self.host_ms = 0.0
        self.rows = 0  # sampling rows over the measured window
        self.step_ms = 0.0
        self.ids = 0
        # (reaches the engine, sent by the client): the first streams come over `ramp_s` (as the
        # load test connects them); then the client sends its next request as soon as the last audio
        # of the one before reached it (closed loop), and the engine has it `request_ms` later
        self.starts = sorted((t, t) for t in (self.rng.uniform(0, args.ramp_s) for _ in range(streams)))

    def open(self, sent: float) -> None:
        rid = f"r{self.ids}"
        self.ids += 1
        frames = self.rng.choice(self.lengths)
        r = Request(request_id=rid, arrival_time=self.now, schedule=self.schedule)
        r.segments.append(
            Segment(text=TextSegment("x", char_start=0), prompt_len=self.args.prompt, max_frames=frames)
        )
        r.text_closed = True
        measured = self.now >= self.args.warmup
        self.offered += measured
        try:
            self.sched.add_request(r)
        except Overloaded as refusal:  # the client retries after Retry-After
            self.refused += measured
            retry = self.now + refusal.retry_after_s
            heapq.heappush(self.starts, (retry + self.request_s, retry))
            return
        ticket = r.ticket
        if ticket is not None and ticket.queued:
            self.queued += measured
        self.players[rid] = (
            PlaybackClock(SAMPLE_RATE, self.args.buffer_ms, clock=lambda: self.now),
            sent,
            frames,
            ticket,
        )

    def step(self) -> None:
        while self.starts and self.starts[0][0] <= self.now:
            self.open(heapq.heappop(self.starts)[1])
        if not self.sched.has_work():  # nothing yet: time passes to the next arrival
            self.now = max(self.now, self.starts[0][0]) if self.starts else self.now + 0.001
            return
        plan = self.sched.schedule()
        admission = self.sched.admission
        self.max_admitted = max(self.max_admitted, len(admission.admitted))
        self.max_queued = max(self.max_queued, admission.queued)
        decode_rows = len(plan.decode) + sum(1 for c in plan.prefill if c.length == 1)
        longer = sum(1 for c in plan.prefill if c.length > 1)
        ms = {
            "decode": self.costs.decode[0] + self.costs.decode[1] * decode_rows if decode_rows else 0.0,
            "prefill": self.costs.prefill_per_chunk * longer,
        }
        sampled = len(plan.sampling_rows)
        ms["sample"] = self.costs.sample[0] + self.costs.sample[1] * sampled if sampled else 0.0
        now_chunks = [(c.num_frames, 0) for c in plan.codec if c.first_chunk]
        now_chunks += [(1, 0)] * len(plan.first_audio_now)
        later_chunks = [(c.num_frames, 0) for c in plan.codec if not c.first_chunk]
        now_launches, later_launches = codec_launches(now_chunks), codec_launches(later_chunks)
        ms["codec_now"], ms["codec_later"] = self._codec_ms(now_launches), self._codec_ms(later_launches)
        host_ms = self.costs.host_step_ms(sampled)
        step_ms = sum(ms.values()) + host_ms
        if self.now >= self.args.warmup:  # the step's figures: over the measured window only
            self.launches += len(now_launches) + len(later_launches)
            self.codec_rows += len(now_chunks) + len(later_chunks)
            self.now_frames += sum(1 for f in plan.first_audio_now if f.frame)
            self.codec_frames += sum(f for f, _ in now_chunks) + sum(f for f, _ in later_chunks)
            for k, v in ms.items():
                self.gpu_ms[k] += v
            self.host_ms += host_ms
            self.steps += 1
            self.rows += sampled
            self.step_ms += step_ms
        self.now += step_ms / 1000
        # this step's first chunks arrive now; the previous step's later chunks too
        # in the runner's order: the previous step's later chunks, then this step's first chunks,
        # then the frames decoded in this step
        kinds = [(rid, n, "later") for rid, n in self.deferred]
        kinds += [(c.request_id, c.num_frames, "first") for c in plan.codec if c.first_chunk]
        kinds += [(f.request_id, 1, "now_frame" if f.frame else "first") for f in plan.first_audio_now]
        delivered = [(rid, n) for rid, n, _ in kinds]
        self.deferred = [(c.request_id, c.num_frames) for c in plan.codec if not c.first_chunk]
        self._note_deliveries(kinds)
        codes = [[7] * 16 for _ in plan.sampling_rows]
        frames: dict[str, int] = defaultdict(int)
        for rid, n in delivered:
            frames[rid] += n
        audio = {rid: _silence(n) for rid, n in frames.items()}
        # the gateway sends a step's audio one stream after another, after what it still had to send
        per_packet_s = self.args.gateway_us_per_packet / 1e6
        for out in self.sched.update(plan, StepOutput(codes=codes, audio=audio, delivered=delivered)):
            if out.audio is not None:
                self.gateway_free = (
                    max(self.now, self.gateway_free) + len(out.audio) / PACKET_SAMPLES * per_packet_s
                )
                self.deliver(out.request_id, len(out.audio))
            if out.finished:
                self.finish(out.request_id)

    def _note_deliveries(self, kinds: list[tuple[str, int, str]]) -> None:
        """What each stream gets in this step: its chunk count so far, the kinds (first chunk, frame
        decoded in its own step, later chunk collected a step after launch), frames, and the
        engine's lead (against its own first audio, as engine.qwen3.delivery_leads counts it)."""
        self.delivery = {}
        for rid, n, kind in kinds:
            r = self.sched.requests.get(rid)
            if r is None:
                continue
            lead = (
                float("nan")
                if r.first_audio_time is None
                else (r.first_audio_time + r.frames_decoded * SAMPLES_PER_FRAME / SAMPLE_RATE - self.now)
            )
            if rid in self.delivery:
                chunk, k, frames, lead0 = self.delivery[rid]
                self.delivery[rid] = (chunk, "+".join(sorted({*k.split("+"), kind})), frames + n, lead0)
            else:
                self.delivery[rid] = (self.chunks[rid], kind, n, lead)
        for rid, (chunk, kind, _, lead) in self.delivery.items():
            self.chunks[rid] += 1
            if chunk and self.now > self.args.warmup and chunk < 8:
                self.leads_by_chunk[chunk].append(lead)
                self.kinds_by_chunk[chunk][kind] += 1

    def _codec_ms(self, launches: list[tuple[int, int]]) -> float:
        return sum(self.costs.launch_ms(rows, frames) for rows, frames in launches)

    def deliver(self, rid: str, samples: int) -> None:
        """Audio reaches the listener after the gateway's and the network's delay, in order."""
        at = max(self.now, self.gateway_free) + self.args.delivery_base_ms / 1000
        if self.args.delivery_jitter_ms > 0:
            at += self.rng.expovariate(1000 / self.args.delivery_jitter_ms)
        at = self._after_stalls(at)
        at = max(at, self.arrived.get(rid, 0.0))
        self.arrived[rid] = at
        player = self.players[rid][0]
        before = player.underruns
        player.on_packet(samples, at)
        if before == 0 and player.underruns and self.now > self.args.warmup:
            chunk, kind, frames, lead = self.delivery.get(rid, (-1, "?", 0, float("nan")))
            self.late.append(
                {
                    "chunk": chunk,
                    "kind": kind,
                    "frames": frames,
                    "lead_ms": 1000 * lead,
                    "delay_ms": 1000 * (at - self.now),
                    "at_audio_s": player.first_underrun_s,
                }
            )

    def _after_stalls(self, at: float) -> float:
        """Audio that would reach its listener during a stall (a pause of everything between the
        engine and the listeners: `--stall-ms` long, `--stalls-per-s` at random) arrives as it ends."""
        if not self.stall_s:
            return at
        while self.stalls[-1] <= at:
            self.stalls.append(self.stalls[-1] + self.stall_rng.expovariate(self.args.stalls_per_s))
        i = bisect.bisect_right(self.stalls, at) - 1
        return self.stalls[i] + self.stall_s if i >= 0 and at < self.stalls[i] + self.stall_s else at

    def finish(self, rid: str) -> None:
        player, sent, frames, ticket = self.players.pop(rid)
        last = self.arrived.pop(rid, self.now)
        self.chunks.pop(rid, None)
        waited = 0.0 if ticket is None else ticket.waited_s
        start = sent if not waited else ticket.admitted_at  # TTFA and RTF from admission
        if waited and ticket.admitted_at >= self.args.warmup:
            self.waits.append(waited)
        if player.first_packet_at is not None and self.now > self.args.warmup:
            audio_s = frames * SAMPLES_PER_FRAME / SAMPLE_RATE
            self.done.append(
                {
                    "ttfa": player.first_packet_at - start,
                    "rtf": (self.now - start) / audio_s,
                    "underrun": float(player.underruns > 0),
                    "audio_s": audio_s,
                    "first_underrun_s": player.first_underrun_s,
                    "early": float(
                        player.first_underrun_s is not None and player.first_underrun_s <= EARLY_UNDERRUN_S
                    ),
                }
            )
        sent = max(self.now, last)  # the closed-loop client sends its next request
        heapq.heappush(self.starts, (sent + self.request_s, sent))

    def run(self) -> dict[str, Any]:
        while self.now < self.args.warmup + self.args.seconds:
            self.step()
        d = self.done
        window = self.args.seconds
        steps = max(1, self.steps)
        firsts = [x["first_underrun_s"] for x in d if x["first_underrun_s"] is not None]
        leads = self.sched.leads.snapshot(self.now)
        return {
            "streams": self.level,
            "requests": len(d),
            "ttfa_p50_ms": round(1000 * _pct([x["ttfa"] for x in d], 50), 1),
            "ttfa_p90_ms": round(1000 * _pct([x["ttfa"] for x in d], 90), 1),
            "ttfa_p99_ms": round(1000 * _pct([x["ttfa"] for x in d], 99), 1),
            "rtf_p50": round(_pct([x["rtf"] for x in d], 50), 3),
            "rtf_p90": round(_pct([x["rtf"] for x in d], 90), 3),
            "underrun_streams_pct": round(100 * statistics.fmean(x["underrun"] for x in d), 2) if d else None,
            "underrun_in_first_s_pct": round(100 * statistics.fmean(x["early"] for x in d), 2) if d else None,
            "underrun_first_s_p50": round(_pct(firsts, 50), 2) if firsts else None,
            "audio_s_per_s": round(sum(x["audio_s"] for x in d) / window, 1),
            "capacity": self.sched.admission.capacity(),
            "offered": self.offered,
            "queued": self.queued,
            "refused": self.refused,
            "queue_wait_p50_ms": round(1000 * _pct(self.waits, 50), 1) if self.waits else None,
            "queue_wait_p90_ms": round(1000 * _pct(self.waits, 90), 1) if self.waits else None,
            "max_admitted": self.max_admitted,
            "max_queued": self.max_queued,
            "step_ms": round(self.step_ms / steps, 2),
            "rows_per_step": round(self.rows / steps, 1),
            "codec_rows_per_step": round(self.codec_rows / steps, 1),
            "codec_frames_per_step": round(self.codec_frames / steps, 1),
            "codec_launches_per_step": round(self.launches / steps, 2),
            "now_frame_rows_per_step": round(
                self.now_frames / steps, 1
            ),  # later frames decoded in their own step
            **{f"gpu_ms_{k}": round(v / steps, 2) for k, v in self.gpu_ms.items()},
            "host_ms": round(self.host_ms / steps, 2),
            **{k: round(v, 1) for k, v in leads.items() if k.startswith(("lead_chunk_p", "lead_stream"))},
        }

    def late_deliveries(self) -> dict[str, Any]:
        """The measured streams' first underruns: which delivery came late (its index among the
        stream's deliveries, 0 = the first audio), what it carried, the engine's lead on it and its
        delay after the engine."""
        late = self.late

        def by(key: str) -> dict[Any, int]:
            return dict(sorted(Counter(x[key] for x in late).items()))

        return {
            "late_deliveries": len(late),
            "by_chunk": by("chunk"),
            "by_kind": by("kind"),
            "by_frames_received": dict(
                sorted(
                    Counter(round(x["at_audio_s"] / (SAMPLES_PER_FRAME / SAMPLE_RATE)) for x in late).items()
                )
            ),
            "lead_ms_p50": round(_pct([x["lead_ms"] for x in late], 50), 1) if late else None,
            "delay_ms_p50": round(_pct([x["delay_ms"] for x in late], 50), 1) if late else None,
            # every measured stream's deliveries 1-7: the engine's lead p1 / p50 (ms), and what they carried
            "lead_ms_p1_p50_by_chunk": {
                k: [round(1000 * _pct(v, 1)), round(1000 * _pct(v, 50))]
                for k, v in sorted(self.leads_by_chunk.items())
            },
            "kinds_by_chunk": {k: dict(v.most_common(3)) for k, v in sorted(self.kinds_by_chunk.items())},
        }


def _chunk_schedule(text: str | None) -> ChunkSchedule:
    """`first,growth,largest` (e.g. 2,2,25) -> a ChunkSchedule; None: the default."""
    if not text:
        return ChunkSchedule()
    first, growth, largest = text.split(",")
    return ChunkSchedule(int(first), float(growth), int(largest))


def _silence(frames: int) -> Any:
    return range(frames * SAMPLES_PER_FRAME)  # only its length is read


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="256,384,512", help="closed-loop streams offered, per level")
    ap.add_argument(
        "--slots",
        type=int,
        default=None,
        help="the engine's upper bound: talker slots, Code2Wav rows, decode batch (default: the level)",
    )
    ap.add_argument("--queue-limit", type=int, default=None, help="requests waiting for admission at most")
    ap.add_argument("--seconds", type=float, default=30.0, help="simulated seconds measured per level")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--ramp-s", type=float, default=2.0, help="the first streams arrive over this")
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        help="talker, sampling and host costs of a calibration (see above)",
    )
    ap.add_argument("--host-ms", type=float, default=None, help="host work per step the GPU does not overlap")
    ap.add_argument(
        "--host-us-per-row",
        type=float,
        default=None,
        help="host work per sampling row past --host-rows-overlapped the GPU does not overlap",
    )
    ap.add_argument("--host-rows-overlapped", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="arrivals, lengths and delivery jitter")
    ap.add_argument(
        "--codec-scale",
        type=float,
        default=None,
        help="Code2Wav time in the engine over the isolated bench's (default: the preset's, see above)",
    )
    ap.add_argument("--prompt", type=int, default=1, help="prompt positions left after the prefix cache")
    ap.add_argument("--buffer-ms", type=float, default=150.0)
    ap.add_argument(
        "--schedule",
        default=None,
        metavar="FIRST,GROWTH,LARGEST",
        help="the requests' chunk schedule (engine.api.ChunkSchedule; default its own)",
    )
    ap.add_argument(
        "--request-ms",
        type=float,
        default=0.0,
        help="client to engine: a closed-loop request reaches the engine this long after it is sent",
    )
    ap.add_argument(
        "--explain",
        action="store_true",
        help="also print, per level, which delivery came late at each measured stream's first underrun",
    )
    ap.add_argument("--delivery-base-ms", type=float, default=0.0, help="engine to listener, fixed part")
    ap.add_argument(
        "--gateway-us-per-packet",
        type=float,
        default=0.0,
        help="the gateway's time per 20 ms packet: a step's audio leaves in the order of its outputs, "
        "after what the gateway had left to send",
    )
    ap.add_argument(
        "--delivery-jitter-ms",
        type=float,
        default=0.0,
        help="engine to listener, mean of an exponential extra delay per delivery",
    )
    ap.add_argument(
        "--stall-ms",
        type=float,
        default=0.0,
        help="a pause of everything after the engine (gateway, network, client): audio due in it arrives at its end",
    )
    ap.add_argument("--stalls-per-s", type=float, default=0.0, help="how often such pauses come (Poisson)")
    ap.add_argument("--merge-below", type=int, default=None, help="the scheduler's merge_codec_groups_below")
    ap.add_argument("--smooth", type=float, default=None, help="the scheduler's codec_frames_over_production")
    ap.add_argument(
        "--set",
        action="append",
        metavar="FIELD=JSON",
        help="a SchedulerConfig field, e.g. --set max_early_codec_rows=64 (repeatable)",
    )
    ap.add_argument("--costs", type=Path, default=None, help="a cost model as JSON (see Costs)")
    ap.add_argument("--codec-shapes", type=Path, default=None, help="bench/gpu_codec_bench.py --json output")
    args = ap.parse_args()
    costs = load_costs(args.costs, args.codec_shapes, args.preset)
    for name in ("host_ms", "host_us_per_row", "host_rows_overlapped", "codec_scale"):
        if getattr(args, name) is not None:
            setattr(costs, name, getattr(args, name))
    for n in args.streams.split(","):
        sim = Simulation(args, int(n), costs)
        print(json.dumps(sim.run()))
        if args.explain:
            print(json.dumps({"streams": int(n), **sim.late_deliveries()}))


if __name__ == "__main__":
    main()
