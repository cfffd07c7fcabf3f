"""Continuous batching for the talker and Code2Wav: which rows run in the next step (no torch).

A new request is first admitted by measured cost (engine.qwen3.capacity: the step time measured by
batch size, against a frame's audio), or waits in engine.admission's bounded queue, or is refused.
Every step:
1. admission: waiting requests take a free talker slot (and a Code2Wav row on first admission),
   interactive before bulk, then the earliest deadline; an interactive request may preempt a
   bulk one when no talker slot is free (the bulk one later recomputes its context);
2. decode: every request in DECODING samples one frame;
3. chunked prefill: prompts fill the rest of the step's token budget, a chunk at a time, so a new
   request's first frame never waits behind a long prompt;
4. Code2Wav: per request, the next chunk of its schedule (1-2 frames first, then growing) when
   enough frames are ready, or sooner when the listener's buffer would otherwise run dry; then,
   since each chunk size is one graph launch, small groups are cut down to a size already in the
   step, and the step's frames are held near what the talker makes, chunks that can wait waiting.
"""

from __future__ import annotations

import json
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

from engine.admission import Admission
from engine.api import ChunkSchedule, Priority
from engine.qwen3.capacity import HEADROOM, INITIAL_STREAMS, StepCapacity
from engine.qwen3.delivery_leads import DeliveryLeads
from engine.qwen3.kv_cache import KVCacheManager, SlotPool
from engine.qwen3.plan import (
    CodecChunk,
    DecodeRow,
    FirstAudio,
    Frame,
    PrefillChunk,
    PrefixCopy,
    RequestOutput,
    StepOutput,
    StepPlan,
)
from engine.qwen3.request import SAMPLE_RATE, SAMPLES_PER_FRAME, Request, RequestStatus, Segment

FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE  # audio seconds per codec frame
ON_SCHEDULE, EARLY, FLUSH = 0, 1, 2  # why a Code2Wav chunk has its size (Scheduler._codec_ready)
EOS_CODE = 2150  # Qwen3-TTS-12Hz's codebook-0 end of segment
IDLE_GAP_S = 1.0  # a longer wait between two steps is an idle engine, not a step
# module constants: cheaper than attribute lookups on the enum in the per-row loops (and a tuple,
# not a set: an enum member's hash is a Python-level call)
_PREFILLING, _DECODING, _DRAINING = RequestStatus.PREFILLING, RequestStatus.DECODING, RequestStatus.DRAINING
_HOLDS_KV = (_PREFILLING, _DECODING)
_FINISHED = RequestStatus.FINISHED_STOPPED  # this status and the ones after it end a request


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's settings; `cadence serve --scheduler FIELD=JSON` sets any of them. The four
    sizes that may be 0 follow the talker slots the KV budget holds (`sized`)."""

    max_batch: int = (
        64  # rows sampling a frame per step (decode rows + prefill chunks); 0: min(streams, slots)
    )
    max_tokens_per_step: int = 512  # decode rows count one token each; prefill fills the rest; 0: batch + 512
    max_prefill_chunk: int = 256  # positions of one request's prompt per step
    codec_slots: int = 64  # Code2Wav state rows = requests active at once at most; 0: one per talker slot
    queue_limit: int = 256  # requests waiting for admission; more -> Overloaded
    # admission by measured cost (engine.qwen3.capacity): the step predicted for the admitted
    # streams stays within this share of a frame's audio; `initial_streams` are admitted before
    # a measured step says otherwise
    headroom: float = HEADROOM
    initial_streams: int = INITIAL_STREAMS
    max_codec_rows: int = 64  # Code2Wav rows per step; 0: the batch
    # rows per step whose chunk goes out below its scheduled size because the listener's buffer runs
    # low. Beyond these, late rows wait a step and grow: under overload, every late stream flushing
    # one frame per step would keep Code2Wav at its least efficient shape, which keeps the streams
    # late; too high a cap lengthens every step (bench/sim_engine.py explores the trade)
    max_early_codec_rows: int = 128
    # later chunks of one size whose group has fewer rows than this are cut down to a smaller size
    # present in the same step, saving a Code2Wav launch (0: never)
    merge_codec_groups_below: int = 32
    # a step's Code2Wav frames are held near this many times the frames the talker makes per step;
    # chunks whose listeners can wait go in a later step (0: no limit)
    codec_frames_over_production: float = 1.5
    codec_frame_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 25)  # allowed chunk sizes (graph buckets)
    ttfa_target_s: float = 0.025  # first audio is due this long after a request arrives
    # emit a short chunk (or decode a frame in its own step) when the buffer would run dry sooner
    # than this: a wide margin absorbs the pauses of the gateway and the step's own jitter, at the
    # price of more, smaller Code2Wav launches
    safety_margin_s: float = 0.4
    # rows per step whose just-sampled frame is decoded in the same step, like a first frame, because
    # their listener would run dry before that frame's next-step launch and delivery (the most urgent
    # first; a stream with a chunk in the step is left out). With a deferring runner a stream's
    # second chunk otherwise comes three steps after its first audio, and long steps early in a
    # stream are where underruns begin. 0: off
    max_now_frame_rows: int = 64
    preempt_bulk: bool = True  # interactive requests may take a bulk request's talker slot

    def __post_init__(self) -> None:
        if self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be positive")
        sizes = (self.max_batch, self.max_tokens_per_step, self.codec_slots, self.max_codec_rows)
        if min(sizes) < 0:
            raise ValueError("max_batch, max_tokens_per_step, codec_slots and max_codec_rows must be >= 0")
        if not self.codec_frame_buckets or min(self.codec_frame_buckets) != 1:
            raise ValueError("codec_frame_buckets must contain 1")
        self.codec_frame_buckets = tuple(sorted(set(self.codec_frame_buckets)))

    def sized(self, talker_slots: int) -> SchedulerConfig:
        """A copy whose sizes left at 0 follow the talker slots: a stream per slot, a decode row for
        every stream a slot can hold, the step's token budget room for new prompts beside them."""
        streams = self.codec_slots or talker_slots
        batch = self.max_batch or min(streams, talker_slots)
        return replace(
            self,
            codec_slots=streams,
            max_batch=batch,
            max_codec_rows=self.max_codec_rows or batch,
            max_tokens_per_step=self.max_tokens_per_step or batch + 512,
        )

    def override(self, items: Iterable[str]) -> SchedulerConfig:
        """Set fields from `FIELD=JSON` strings (`max_early_codec_rows=96`, `preempt_bulk=false`),
        each checked against the field's current type; a wrong name or type raises ValueError.
        Returns this config."""
        names = [f.name for f in fields(self)]
        for item in items:
            key, sep, text = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise ValueError(
                    f"scheduler option {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(names))}"
                )
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"scheduler option {key}: {text!r} is not a JSON value") from e
            current = getattr(self, key)
            if isinstance(current, tuple) and isinstance(value, list):
                value = tuple(value)
            elif isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not type(current):
                raise ValueError(f"scheduler option {key}: expected {type(current).__name__}, got {text!r}")
            setattr(self, key, value)
        self.__post_init__()
        return self


def chunk_frames(schedule: ChunkSchedule, index: int) -> int:
    """Frames in chunk `index` of a schedule: first, first*growth, ... capped at largest."""
    size = round(schedule.first * schedule.growth**index) if index < 64 else schedule.largest
    return max(1, min(schedule.largest, int(size)))


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        prefix_lookup: Callable[[str, int], bool] | None = None,
        *,
        eos_code: int = EOS_CODE,
        codec_delivery_steps: int = 0,
    ) -> None:
        if 0 in (config.max_batch, config.max_tokens_per_step, config.codec_slots, config.max_codec_rows):
            raise ValueError(
                "a scheduler needs its sizes: SchedulerConfig.sized(talker slots) resolves the 0s"
            )
        self.config = config
        self.eos_code = eos_code  # the model's codebook-0 id that ends a segment (not a frame)
        # steps between a Code2Wav chunk's launch and its audio: the runner's (1 when it defers)
        self.codec_delivery_steps = codec_delivery_steps
        # (key, positions) -> cached? A hit starts the segment's prefill after its prompt prefix
        self.prefix_lookup = prefix_lookup
        self._prefix_copies: list[PrefixCopy] = []
        self.kv = kv
        self.codec_pool = SlotPool(config.codec_slots)
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # status WAITING, ordered at each schedule()
        self.running: list[Request] = []  # PREFILLING / DECODING (hold a talker slot)
        # running means: the time from one step to the next (frames come once a step: the deadline
        # estimates), and the part of it from planning to the step's results
        self.step_time_s = 0.02
        self.step_busy_s = 0.02
        self._frames_per_step = float(config.max_batch)  # running mean of frames sampled per step
        self._step = 0
        self._freed_kv: list[int] = []
        self._codec_resets: list[int] = []
        self._last_schedule: float | None = None
        self.ttfa_window_s = 60.0
        self._ttfas: deque[tuple[float, float]] = deque()  # (time of first audio, TTFA) over the window
        self._targets: dict[tuple[ChunkSchedule, int], int] = {}  # (schedule, chunk index) -> frames
        self._caught_up: list[Request] = []  # requests with no frame pending at this step's Code2Wav plan
        self.leads = DeliveryLeads()
        self.finished = 0  # requests ended, any status
        self.capacity = StepCapacity(FRAME_S, config.headroom, initial_streams=config.initial_streams)
        self.admission: Admission[Request] = Admission(
            config.codec_slots,
            config.queue_limit,
            capacity=lambda: self.capacity.capacity(self.config.codec_slots),
            starts=lambda: self.capacity.starts(
                len(self.running), len(self._awaiting_first), self.config.max_tokens_per_step
            ),
            clock=clock,
        )
        self._awaiting_first: set[str] = set()  # admitted with text, no first audio yet
        self._measured_rows = 0  # rows of the last step, when the next one follows at once
        self._last_plan_ran = False  # the last plan had work (the time to the next one is a step)

    # -- inputs (called between steps) -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.ticket = self.admission.arrive(request, request.priority, request.max_wait_s)  # or Overloaded
        self.requests[request.request_id] = request
        if request.segments:
            self._start_next_segment(request)
        elif request.text_closed:  # nothing to say: it ends here, and its admission place with it
            self._finish(request, RequestStatus.FINISHED_STOPPED)

    def add_segment(self, request_id: str, segment: Segment) -> None:
        r = self.requests.get(request_id)
        if r is None or r.is_finished:
            return
        if r.text_closed:
            raise ValueError(f"request {request_id!r}: text already closed")
        r.segments.append(segment)
        if r.status == RequestStatus.WAITING_FOR_TEXT:
            self._start_next_segment(r)

    def close_text(self, request_id: str) -> list[RequestOutput]:
        r = self.requests.get(request_id)
        if r is None or r.is_finished:
            return []
        r.text_closed = True
        if r.status == RequestStatus.WAITING_FOR_TEXT:
            r.status = RequestStatus.DRAINING
            return self._finish_if_drained(r)
        return []

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        outs = []
        for rid in request_ids:
            r = self.requests.get(rid)
            if r is not None and not r.is_finished:
                outs.append(self._finish(r, RequestStatus.FINISHED_CANCELLED))
        return outs

    def fail(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        outs = []
        for rid in request_ids:
            r = self.requests.get(rid)
            if r is not None and not r.is_finished:
                r.error = error
                outs.append(self._finish(r, RequestStatus.FINISHED_ERROR))
        return outs

    def expire(self) -> list[RequestOutput]:
        """Requests still queued for admission when their own max wait passed: refused."""
        outs = []
        for ticket in self.admission.expire():
            r = ticket.item
            if r.request_id in self.requests and not r.is_finished:
                error = self.admission.expired_error(ticket)
                r.error, r.retry_after_s = str(error), error.retry_after_s
                outs.append(self._finish(r, RequestStatus.FINISHED_ERROR))
        return outs

    def until_expiry(self) -> float | None:
        """Seconds until a queued request's max wait passes (None: none waits with one)."""
        return self.admission.until_expiry()

    def _promote(self) -> None:
        """Admit the queued requests the measured cost has room for now."""
        for ticket in self.admission.admit_waiting():
            r = ticket.item
            r.arrival_time = self.clock()  # its first-audio deadline and TTFA count from admission
            if r.status == RequestStatus.WAITING and r.current is not None:
                self.waiting.append(r)
                self._awaiting_first.add(r.request_id)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        now = self.clock()
        # only a plan that ran makes the time to this one a step's: after an empty plan the loop
        # sleeps (a stream waiting for its next text), and that wait is no step's cost
        if self._last_plan_ran and self._last_schedule is not None and now - self._last_schedule < IDLE_GAP_S:
            self.step_time_s += 0.1 * (now - self._last_schedule - self.step_time_s)
            if self._measured_rows:  # the step before ran straight into this one: its cost
                self.capacity.step(self._measured_rows, now - self._last_schedule)
        self._last_schedule = now
        self._step += 1
        plan = StepPlan(step=self._step)
        self._promote()
        self._admit()
        budget = self.config.max_tokens_per_step
        if len(self.running) > min(self.config.max_batch, budget):  # who goes first matters only then
            self.running.sort(key=Request.sort_key)
        prefilling = self._plan_decode(plan.decode, min(self.config.max_batch, budget))
        rows = len(plan.decode)
        budget -= rows
        prefilling.sort(key=Request.sort_key)
        for r in prefilling:
            seg = r.current
            assert seg is not None
            if budget <= 0 or rows >= self.config.max_batch:
                break
            remaining = seg.context_target - seg.prefilled
            n = min(remaining, budget, self.config.max_prefill_chunk)
            start = seg.prefilled
            plan.prefill.append(
                PrefillChunk(
                    request_id=r.request_id,
                    kv_slot=_slot(r.kv_slot),
                    codec_slot=_slot(r.codec_slot),
                    start=start,
                    length=n,
                    prompt_len=seg.prompt_len,
                    payload=seg.payload,
                    samples_frame=n == remaining,
                    frame_index=seg.frames,
                    utterance_frame=r.frames_generated,
                    codes=r.codes[seg.first_frame : seg.first_frame + seg.frames] if seg.frames else [],
                    sampling=r.sampling,
                    copied=seg.copied,
                    prefix_key=seg.prefix_key,
                    prefix_len=seg.prefix_len,
                )
            )
            budget -= n
            rows += 1
            plan.num_prefill_tokens += n
            if start == seg.copied and not r.codes:  # a new stream's prompt: what its first audio waits for
                self.capacity.prompt(seg.context_target - seg.copied)
        plan.codec = self._schedule_codec(now)
        for c in plan.codec:
            r = self.requests[c.request_id]
            r.frames_launched += c.num_frames
            r.chunks_emitted += 1
        plan.first_audio_now = self._first_audio_now(plan, now)
        # a chunk in this plan is audio in flight (checked first: it spares the pass at load)
        plan.audio_in_flight = bool(plan.codec) or any(
            r.frames_launched != r.frames_decoded for r in self.requests.values()
        )
        plan.prefix_copies, self._prefix_copies = self._prefix_copies, []
        plan.freed_kv_slots, self._freed_kv = self._freed_kv, []
        plan.codec_resets, self._codec_resets = self._codec_resets, []
        self._last_plan_ran = not plan.is_empty
        return plan

    def _plan_decode(self, decode: list[DecodeRow], limit: int) -> list[Request]:
        """One pass over the running set: a decode row for each of its first `limit` decoding
        requests, and its prefilling requests returned (both in running order)."""
        prefilling = []
        room, add_row = limit - len(decode), decode.append
        for r in self.running:
            seg = r.current
            if seg is None:
                continue
            status = r.status
            if status == _DECODING:
                if room > 0:
                    room -= 1
                    kv_slot, codec_slot = r.kv_slot, r.codec_slot
                    if kv_slot is None or codec_slot is None:
                        raise RuntimeError("request holds no slot")
                    # positional arguments: half the cost of keywords, once per row and step
                    add_row(
                        DecodeRow(
                            r.request_id,
                            kv_slot,
                            codec_slot,
                            seg.prefilled,
                            seg.frames,
                            len(r.codes),
                            seg.payload,
                            r.sampling,
                        )
                    )
            elif status == _PREFILLING:
                prefilling.append(r)
        return prefilling

    def update(self, plan: StepPlan, output: StepOutput) -> list[RequestOutput]:
        now = self.clock()
        if self._last_schedule is not None:
            self.step_busy_s += 0.1 * (max(0.0, now - self._last_schedule) - self.step_busy_s)
        outs: dict[str, RequestOutput] = {}

        def out_for(r: Request) -> RequestOutput:
            o = outs.get(r.request_id)
            if o is None:
                o = outs[r.request_id] = RequestOutput(r.request_id)
            return o

        rows = plan.sampling_rows
        self._frames_per_step += 0.1 * (len(rows) - self._frames_per_step)
        self._measured_rows = len(rows) if self.running else 0
        codes = output.codes
        if len(codes) != len(rows):
            raise ValueError(f"runner returned {len(codes)} frames for {len(rows)} rows")
        self._advance_prefill(plan.prefill)
        self._take_decode_frames(plan.decode, codes, out_for)
        requests = self.requests
        decoded = len(plan.decode)  # the prompt chunks' frames follow the decode rows' ones
        for rid, frame in zip(rows[decoded:], codes[decoded:], strict=True):
            r = requests.get(rid)
            if r is not None and r.status < _FINISHED:
                self._append_frame(r, frame, out_for)
        for f in plan.first_audio_now:  # a frame decoded in its own step (none when it was EOS)
            r = self._live(f.request_id)
            if r is not None and r.frames_generated > f.frame and r.frames_launched == f.frame:
                r.frames_launched, r.chunks_emitted = f.frame + 1, r.chunks_emitted + 1
        delivered = output.delivered
        if delivered is None:  # the runner decoded this plan's chunks in this step
            delivered = [(c.request_id, c.num_frames) for c in plan.codec]
            delivered += [(f.request_id, 1) for f in plan.first_audio_now if f.request_id in output.audio]
        self._deliver(delivered, output, now, outs)
        for o in outs.values():
            r = requests.get(o.request_id)
            if r is not None:
                if r.status == _DRAINING:
                    for fin in self._finish_if_drained(r):
                        o.finished = fin.finished
                o.status = r.status
        return list(outs.values())

    def _advance_prefill(self, prefill: list[PrefillChunk]) -> None:
        """Count the talker positions the plan's prompt chunks wrote."""
        requests, set_length = self.requests, self.kv.set_length
        for chunk in prefill:
            r = requests.get(chunk.request_id)
            if r is not None and r.status < _FINISHED and (seg := r.current) is not None:
                seg.prefilled += chunk.length
                set_length(_slot(r.kv_slot), seg.prefilled)

    def _take_decode_frames(
        self, decode: list[DecodeRow], codes: list[Frame], out_for: Callable[[Request], RequestOutput]
    ) -> None:
        """Each live decode row wrote one talker position and sampled one frame (codes[i] for row i):
        count the position, keep the frame. One pass, the common case of _append_frame inline (a
        frame that neither ends nor fills its segment)."""
        requests, set_length, eos = self.requests, self.kv.set_length, self.eos_code
        for row, frame in zip(decode, codes, strict=False):  # then come the prompt chunks' frames
            r = requests.get(row.request_id)
            if r is None or r.status >= _FINISHED:
                continue
            seg = r.current
            if seg is None:
                self._append_frame(r, frame, out_for)
                continue
            seg.prefilled += 1
            set_length(_slot(r.kv_slot), seg.prefilled)
            if frame[0] != eos and seg.frames + 1 < seg.cap:
                r.codes.append(frame)
                seg.frames += 1
                seg.done = False
                r.status = _DECODING
            else:
                self._append_frame(r, frame, out_for)

    def _deliver(
        self,
        delivered: list[tuple[str, int]],
        output: StepOutput,
        now: float,
        outs: dict[str, RequestOutput],
    ) -> None:
        """Hand out the decoded chunks: each live request's audio (into `outs`, by request id), and its
        lead on the playback clock."""
        requests, audio = self.requests, output.audio
        chunk_lead, ttfa = self.leads.chunk, self._ttfas.append
        for rid, frames in delivered:
            r = requests.get(rid)
            if r is None or r.status >= _FINISHED:
                continue
            o = outs.get(rid)
            if o is None:
                o = outs[rid] = RequestOutput(rid)
            if o.audio is None:  # a stream's deferred chunk and a frame decoded now share one output
                o.sample_offset = r.frames_decoded * SAMPLES_PER_FRAME
                o.audio = audio.get(rid)
            first = r.first_audio_time
            if first is not None:  # a later chunk: its lead on the playback clock
                lead = first + r.frames_decoded * FRAME_S - now
                chunk_lead(now, lead)
                if lead < r.min_lead_s:
                    r.min_lead_s = lead
            r.frames_decoded += frames
            if first is None:
                r.first_audio_time = now
                ttfa((now, now - r.arrival_time))
                self._awaiting_first.discard(rid)

    # -- load ---------------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return self.codec_pool.num_used

    @property
    def num_queued(self) -> int:
        return sum(1 for r in self.requests.values() if r.codec_slot is None)

    def ttfa_p50_s(self) -> float | None:
        """Median time to first audio of the requests whose first audio came in the last window."""
        horizon = self.clock() - self.ttfa_window_s
        while self._ttfas and self._ttfas[0][0] < horizon:
            self._ttfas.popleft()
        values = sorted(t for _, t in self._ttfas)
        return values[len(values) // 2] if values else None

    @property
    def ttfa_samples(self) -> int:
        return len(self._ttfas)

    def has_work(self) -> bool:
        """True when schedule() would produce something to run."""
        if self.running or self._freed_kv or self._codec_resets:
            return True
        if any(
            r.frames_pending or r.frames_in_flight for r in self.requests.values() if r.codec_slot is not None
        ):
            return True
        return any(self._can_admit(r) for r in self.waiting)

    # -- internals ------------------------------------------------------------------------------
    def _live(self, request_id: str) -> Request | None:
        r = self.requests.get(request_id)
        return None if r is None or r.is_finished else r

    def _start_next_segment(self, r: Request) -> None:
        seg = r.segments.popleft()
        seg.first_frame = r.frames_generated
        seg.prefilled = 0
        r.current = seg
        if r.kv_slot is not None:  # back to back: keep the talker slot
            self.kv.set_length(r.kv_slot, 0)
            r.status = RequestStatus.PREFILLING
            self._reuse_prefix(r)
        else:
            r.status = RequestStatus.WAITING
            if r.admitted:  # else it joins once admitted (_promote)
                self.waiting.append(r)
                if r.first_audio_time is None:
                    self._awaiting_first.add(r.request_id)

    def _can_admit(self, r: Request) -> bool:
        if r.codec_slot is None and self.codec_pool.num_free == 0:
            return False
        if self.kv.num_free > 0:
            return True
        return self._victim_for(r) is not None

    def _victim_for(self, r: Request) -> Request | None:
        if not self.config.preempt_bulk or r.priority != Priority.INTERACTIVE:
            return None
        bulk = [v for v in self.running if v.priority > r.priority]
        return max(bulk, key=lambda v: v.deadline, default=None)

    def _admit(self) -> None:
        self.waiting.sort(key=Request.sort_key)
        still: list[Request] = []
        for r in self.waiting:
            if not self._can_admit(r):
                still.append(r)
                continue
            if self.kv.num_free == 0:
                victim = self._victim_for(r)
                assert victim is not None
                self._preempt(victim)
                still.append(victim)
            if r.codec_slot is None:
                r.codec_slot = self.codec_pool.allocate(r.request_id)
                self._codec_resets.append(_slot(r.codec_slot))
            r.kv_slot = self.kv.allocate(r.request_id)
            assert r.current is not None
            r.current.prefilled = 0
            r.status = RequestStatus.PREFILLING
            self._reuse_prefix(r)
            self.running.append(r)
        self.waiting = still

    def _reuse_prefix(self, r: Request) -> None:
        """A segment starting in its slot: take its prompt prefix from the cache when it is there."""
        seg = r.current
        assert seg is not None and r.kv_slot is not None
        seg.copied = 0
        if (
            self.prefix_lookup is None
            or seg.prefix_key is None
            or not 0 < seg.prefix_len < seg.context_target
        ):
            return
        if not self.prefix_lookup(seg.prefix_key, seg.prefix_len):
            return
        seg.prefilled = seg.copied = seg.prefix_len
        self.kv.set_length(r.kv_slot, seg.prefix_len)
        self._prefix_copies.append(PrefixCopy(r.kv_slot, seg.prefix_key, seg.prefix_len))

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._release_kv(r)
        assert r.current is not None
        r.current.prefilled = 0
        r.status = RequestStatus.WAITING
        r.preemptions += 1

    def _release_kv(self, r: Request) -> None:
        if r.kv_slot is not None:
            self._prefix_copies = [c for c in self._prefix_copies if c.kv_slot != r.kv_slot]
            self.kv.free(r.kv_slot)
            self._freed_kv.append(r.kv_slot)
            r.kv_slot = None

    def _segment_cap(self, seg: Segment) -> int:
        if not seg.cap:  # the prompt's length is known once the segment runs
            seg.cap = max(1, min(seg.max_frames, self.kv.layout.max_len - seg.prompt_len))
        return seg.cap

    def _append_frame(self, r: Request, codes: Frame, out_for: Callable[[Request], RequestOutput]) -> None:
        seg = r.current
        assert seg is not None
        if codes[0] == self.eos_code:
            seg.done = True
        else:
            # the runner's row (a tuple, engine.qwen3.plan.Frame) becomes the request's frame: a copy per
            # row and step would only feed the garbage collector
            r.codes.append(codes)
            seg.frames += 1
            seg.done = seg.frames >= (seg.cap or self._segment_cap(seg))
        if not seg.done:
            r.status = _DECODING
            return
        r.done_segments.append(seg)
        out_for(r).finished_segments.append(seg)
        r.current = None
        if r.segments:
            self._start_next_segment(r)
            return
        self.running.remove(r)
        self._release_kv(r)
        r.status = RequestStatus.DRAINING if r.text_closed else RequestStatus.WAITING_FOR_TEXT

    def _finish_if_drained(self, r: Request) -> list[RequestOutput]:
        if r.status == RequestStatus.DRAINING and r.frames_pending == 0 and r.frames_in_flight == 0:
            return [self._finish(r, RequestStatus.FINISHED_STOPPED)]
        return []

    def _finish(self, r: Request, status: RequestStatus) -> RequestOutput:
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self._release_kv(r)
        if r.codec_slot is not None:
            self.codec_pool.free(r.codec_slot)
            r.codec_slot = None
        r.status = status
        if status == RequestStatus.FINISHED_STOPPED:
            self.leads.stream_done(self.clock(), r.min_lead_s)
        self.requests.pop(r.request_id, None)
        self.finished += 1
        self._awaiting_first.discard(r.request_id)
        if r.ticket is not None:
            self.admission.leave(r.ticket)
            r.ticket = None
            self._promote()
        return RequestOutput(
            r.request_id, finished=True, status=status, error=r.error, retry_after_s=r.retry_after_s
        )

    def _snap(self, frames: int) -> int:
        """The largest codec bucket of at most `frames` frames (0: none); the buckets are sorted."""
        buckets = self.config.codec_frame_buckets
        i = bisect_right(buckets, frames)
        return buckets[i - 1] if i else 0

    def _chunk_target(self, schedule: ChunkSchedule, index: int) -> int:
        """Frames of chunk `index`, snapped to a codec bucket (memoised: asked per row per step)."""
        key = (schedule, index)
        target = self._targets.get(key)
        if target is None:
            target = self._targets[key] = self._snap(chunk_frames(schedule, index))
        return target

    def _first_audio_now(self, plan: StepPlan, now: float) -> list[FirstAudio]:
        """Sampling rows whose frame is decoded in this step: requests' first frames, when the first
        chunk is one frame (only prompt chunks can sample one: a decoding request has sampled a frame
        already), and up to `max_now_frame_rows` frames whose listener runs low."""
        out = []
        for c in plan.prefill:
            if not c.samples_frame:
                continue
            r = self.requests[c.request_id]
            if r.codes or r.chunks_emitted or r.codec_slot is None:  # not fresh (most rows)
                continue
            if self._chunk_target(r.schedule, 0) == 1:
                out.append(FirstAudio(c.request_id, r.codec_slot))
        if self.config.max_now_frame_rows:
            out += self._frames_running_low(plan, now)
        return out

    def _frames_running_low(self, plan: StepPlan, now: float) -> list[FirstAudio]:
        """Sampling rows of streams whose listener would run dry before the frame sampled now could
        be launched in the next step and delivered (the most urgent first, at most
        `max_now_frame_rows`); a stream with a chunk in this step is left out (its chunk comes first)."""
        wait = self.config.safety_margin_s + (2 + self.codec_delivery_steps) * self.step_time_s
        in_step = {c.request_id for c in plan.codec}
        rows = plan.sampling_rows
        row_of = {rid: i for i, rid in enumerate(rows)}
        low: list[tuple[float, int, Request]] = []
        # only a request with no frame pending when the Code2Wav work was planned can qualify (a few
        # of the rows): the rest had frames left over or launched them in this step's chunks
        for r in self._caught_up:
            rid = r.request_id
            i = row_of.get(rid)
            if (
                i is not None
                and r.chunks_emitted
                and r.codec_slot is not None
                and len(r.codes) == r.frames_launched
                and rid not in in_step
            ):
                deadline = r.deadline
                if deadline - now < wait:
                    low.append((deadline, i, r))
        low.sort()  # by deadline, then row (unique: the tuples never compare further)
        chosen = low[: self.config.max_now_frame_rows]
        return [FirstAudio(r.request_id, _slot(r.codec_slot), len(r.codes)) for _, _, r in chosen]

    def _schedule_codec(self, now: float) -> list[CodecChunk]:
        config = self.config
        ready = self._codec_ready(now)
        # first chunks, then the most urgent, then the order the requests came in (the index is
        # unique: the tuples never compare further)
        ready.sort()
        chosen: list[tuple[Request, int, int]] = []
        early = 0
        for _, _, _, r, n, why in ready:
            if len(chosen) >= config.max_codec_rows:
                break
            if why == EARLY:
                if early >= config.max_early_codec_rows:
                    continue
                early += 1
            chosen.append((r, n, why))
        if config.merge_codec_groups_below:
            self._merge_small_groups(chosen, now)
        if config.codec_frames_over_production:
            chosen = self._smooth(chosen, now)
        work: list[CodecChunk] = []
        for r, n, _ in chosen:
            start = r.frames_launched
            work.append(
                CodecChunk(
                    r.request_id,
                    _slot(r.codec_slot),
                    start,
                    r.codes[start : start + n],
                    r.chunks_emitted == 0,
                )
            )
        return work

    def _codec_ready(self, now: float) -> list[tuple[bool, float, int, Request, int, int]]:
        """(a later chunk, deadline, index in arrival order, request, frames, why) of each request
        with a Code2Wav chunk to decode now: the schedule's next size (ON_SCHEDULE) once that many
        frames are pending, else the pending frames snapped to a bucket when no frame is coming soon
        (FLUSH) or a later chunk's listener runs low (EARLY). Also keeps the requests with no frame
        pending in `_caught_up`, the candidates for frames decoded in their own step.
        One pass over every request per step: the per-request work is inline (no calls on the
        common path, a request waiting for more frames)."""
        config = self.config
        snap, chunk_target = self._snap, self._chunk_target
        step_time, margin, delivery_steps = (
            self.step_time_s,
            config.safety_margin_s,
            self.codec_delivery_steps,
        )
        ready = []
        caught_up: list[Request] = []
        for i, r in enumerate(self.requests.values()):
            if r.codec_slot is None:
                continue
            pending = len(r.codes) - r.frames_launched
            if pending <= 0:
                caught_up.append(r)
                continue
            emitted = r.chunks_emitted
            if r.next_chunk_index != emitted:  # the next chunk's size, memoised on the request
                r.next_chunk_index, r.next_chunk_frames = emitted, chunk_target(r.schedule, emitted)
            target = r.next_chunk_frames
            if pending >= target:
                n, why = target, ON_SCHEDULE
            elif r.status not in _HOLDS_KV:  # no frame is coming soon: flush what is there
                n, why = snap(pending), FLUSH
            elif emitted == 0:  # a first chunk waits for its full size
                continue
            elif r.deadline - now < (target - pending + delivery_steps) * step_time + margin:
                n, why = snap(pending), EARLY  # the listener would run dry before the full chunk
            else:
                continue
            ready.append((emitted > 0, r.deadline, i, r, n, why))
        self._caught_up = caught_up
        return ready

    def _smooth(self, chosen: list[tuple[Request, int, int]], now: float) -> list[tuple[Request, int, int]]:
        """Keep a step's Code2Wav frames near what the talker makes per step: past
        `codec_frames_over_production` times that, chunks whose listeners can wait two more steps
        wait (the most urgent go first: `chosen` is in urgency order). Without it, chunks that come
        due together make a step several times longer than the others, and every stream waiting
        for its first audio waits that long."""
        budget = max(
            self.config.codec_frames_over_production * self._frames_per_step,
            self.config.codec_frame_buckets[-1],
        )
        wait = self.config.safety_margin_s + (2 + self.codec_delivery_steps) * self.step_time_s
        kept, frames = [], 0
        for r, n, why in chosen:
            frames += n
            if frames > budget and r.chunks_emitted and why != FLUSH and r.deadline - now >= wait:
                frames -= n
                continue
            kept.append((r, n, why))
        return kept

    def _merge_small_groups(self, chosen: list[tuple[Request, int, int]], now: float) -> None:
        """Fewer Code2Wav launches: the later chunks of one size run as one launch per size, and a
        launch costs nearly the same whatever its size at small batches (bench/gpu_codec_bench.py
        gives the cost per shape). A group of fewer than `merge_codec_groups_below` chunks is cut
        down to the next smaller size present in the step when every row of it can wait: after the
        smaller chunk its listener still holds the safety margin and the next step. The rest of
        their frames go in later steps. First chunks and final flushes are never cut."""
        groups: dict[int, list[int]] = {}  # frames -> indices into chosen (later chunks only)
        for i, (r, n, _) in enumerate(chosen):
            if r.chunks_emitted:
                groups.setdefault(n, []).append(i)
        wait = self.config.safety_margin_s + (1 + self.codec_delivery_steps) * self.step_time_s
        for f in sorted(groups, reverse=True):
            rows = groups[f]
            smaller = [m for m, members in groups.items() if m < f and members]
            if not smaller or len(rows) >= self.config.merge_codec_groups_below:
                continue
            m = max(smaller)
            if any(chosen[i][2] == FLUSH or chosen[i][0].deadline + m * FRAME_S - now < wait for i in rows):
                continue
            for i in rows:
                chosen[i] = (chosen[i][0], m, chosen[i][2])
            groups[m] += rows
            groups[f] = []


def _slot(slot: int | None) -> int:
    if slot is None:
        raise RuntimeError("request holds no slot")
    return slot
