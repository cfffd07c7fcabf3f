"""The GPU owner: turns a StepPlan into sampled frames and audio.

Per step:
  Code2Wav chunks      on CUDA only first chunks are collected in their step, the others by the
                       next step, so the host plans that step while the GPU decodes them. Those
                       others are queued right behind the sampling, before the host reads the
                       codes; first chunks, built from those codes, replay graphs of their own on
                       a stream of the highest priority beside them (the first-chunk lane: the two
                       lanes share no static buffer or memory pool)
  talker decode rows   one CUDA graph per batch bucket (on CUDA the decode attention kernel reads
                       each row's own length; elsewhere one graph per attention-length bucket);
                       one-position prompt chunks join these rows
  talker prefill       longer prompt chunks padded into a (rows, positions) bucket's graph
                       (positions beyond a row's chunk go to the cache's scratch cell); larger
                       steps run eagerly
  sampling             codebook 0 (penalty, EOS/control masks, per-row seeds) + the code
                       predictor's 15-step loop, one CUDA graph per batch bucket, over the decode
                       rows and the prefill rows that complete their context
  host transfer        the sampled codes [rows, 16] (and the decoded audio)

Per-stream state lives in device tables indexed by the talker slot (sampling parameters, the
repetition-penalty seen-mask, the last frame's codes, the trailing text track); slot `num_slots` is
a dummy row that padded batch entries read and write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine.api import PCM16_FULL_SCALE
from engine.qwen3.codec_state_cache import CodecStateCache
from engine.qwen3.cuda_graphs import GraphBank, batch_buckets, bucket_for
from engine.qwen3.models import (
    decode_attention,
    fused_conv,
    fused_layer,
    fused_norm,
    fused_rope,
    sampler,
    window_attention,
)
from engine.qwen3.models.codec import Code2Wav
from engine.qwen3.models.config import Qwen3TTSConfig
from engine.qwen3.models.sampler import (
    SEED_MASK,
    SamplingParams,
    mask_talker_logits,
    sample,
    suppression_mask,
    top_k_within_bound,
)
from engine.qwen3.models.talker import Talker
from engine.qwen3.plan import CodecChunk, DecodeRow, Frame, PrefillChunk, StepOutput, StepPlan
from engine.qwen3.prefix_cache import PrefixKVCache
from engine.qwen3.prompt_builder import PromptBuilder, PromptItem
from engine.qwen3.prompts import PromptEmbeds, PromptTokens
from engine.qwen3.stage_figures import StageFigures

_NUMPY = {torch.long: np.int64, torch.float32: np.float32, torch.bool: np.bool_}  # host tensors' dtypes


@dataclass(slots=True)
class RowSampling:
    """One request's sampling settings (host values, written to the slot tables per segment)."""

    seed: int
    greedy: bool = False
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    sub_greedy: bool = False
    sub_temperature: float = 0.9
    sub_top_k: int = 50
    sub_top_p: float = 1.0
    min_new_tokens: int = 2  # EOS masked before this many frames (of a segment)
    end_at: int = 1 << 30  # EOS forced at this frame (max or forced frames of a segment)


@dataclass
class SegmentPrompt:
    """A segment's prompt inputs; `embeds` is built on the step thread by Runner.prepare()."""

    tokens: PromptTokens | None  # None until a one-off clip's prompt is known
    speaker_embedding: Tensor | None = None
    ref_codes: Tensor | None = None
    non_streaming: bool = False
    embeds: PromptEmbeds | None = None
    forced_frames: int | None = None  # this segment's exact length (EOS masked before, forced at it)


@dataclass(slots=True)
class RunnerConfig:
    """The runner's own settings. The sizes it shares with the scheduler (slots, batch, chunk
    sizes) are given to `Runner` by whoever sizes both (the engine: from its SchedulerConfig)."""

    max_len: int = 512  # positions per slot usable by a segment (the cache holds one more: scratch)
    max_trailing: int = 256  # text-track positions per segment
    # attention lengths captured for decode where the decode attention kernel is absent (max_len + 1
    # always)
    kv_buckets: tuple[int, ...] = (128, 256)
    # rows per Code2Wav graph: the codec saturates a large GPU by about 64 rows of 25 frames, while
    # graphs of hundreds of rows would hold tens of GiB of activations
    max_codec_batch: int = 64
    # prompt chunks of 2+ positions: graphs per (rows, positions) bucket; larger steps run eagerly
    prefill_row_buckets: tuple[int, ...] = (1, 2, 4, 8)
    prefill_len_buckets: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    enforce_eager: bool = False  # no CUDA graphs
    # a step's Code2Wav chunks other than first chunks are collected by the next step: the host
    # plans and launches that step while the GPU decodes them (None: on CUDA). On CUDA they are
    # launched right behind the sampling, before the host reads the sampled codes, and first chunks
    # replay graphs of their own on a stream of the highest priority, beside them
    defer_codec: bool | None = None
    # Code2Wav state after a clone's reference clip, kept per voice (engine.qwen3.codec_state_cache)
    codec_state_cache_bytes: int = 64 << 20
    # talker and code-predictor layers as nine kernels each (engine.qwen3.models.fused_layer; CUDA
    # bf16), set up by capture(), after any FP8 quantisation of the linears. The one switch back to
    # eager ops (`cadence serve --no-fused-layers`): the smaller kernels fall back on their own when
    # their start-up check fails (engine.qwen3.models.kernel_guard)
    fused_layers: bool = True


EAGER_CHUNK_FRAMES = 25  # frames per eager Code2Wav call when no graph fits (bounds its activations)
FIRST_LANE_FRAMES = (1, 2)  # first-chunk sizes with graphs of their own (the first-chunk lane)


@dataclass(slots=True)
class _SampledCodes:
    """A step's sampled codes [rows, 16] on their way to the host (done: the copy's event, CUDA)."""

    host: Tensor
    done: torch.cuda.Event | None


def _pcm16(wav: Tensor) -> Tensor:
    """Code2Wav's samples (already within [-1, 1]) as int16 PCM, as `engine.api.pcm16` rounds them:
    made on the device, so the host copies the bytes the gateway sends and converts nothing."""
    return torch.round(wav.float() * PCM16_FULL_SCALE).to(torch.int16)


def _slices(n: int, size: int) -> Iterator[slice]:
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))


class Runner:
    def __init__(
        self,
        talker: Talker,
        codec: Code2Wav,
        cfg: Qwen3TTSConfig,
        config: RunnerConfig,
        *,
        num_slots: int,
        codec_slots: int,
        max_batch: int,
        codec_frame_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 25),
    ) -> None:
        """num_slots: talker KV slots (the scheduler's KV layout); codec_slots: Code2Wav state rows;
        max_batch: rows per talker decode / sampling step; codec_frame_buckets: Code2Wav chunk sizes
        (graph buckets)."""
        self.talker = talker
        self.codec = codec
        self.cfg = cfg
        self.prompt_builder = PromptBuilder(talker, cfg)  # keeps the embeddings that hold no text
        self.config = config
        self.num_slots, self.codec_slots, self.max_batch = num_slots, codec_slots, max_batch
        self.codec_frame_buckets = tuple(sorted(codec_frame_buckets))
        self.max_codec_batch = min(max_batch, config.max_codec_batch)
        p = talker.codec_head.weight
        self.device, self.dtype = p.device, p.dtype
        dev = self.device
        self._pin = dev.type == "cuda"  # host tensors copied to the GPU are built in pinned memory
        tc = cfg.talker
        self.groups = tc.num_code_groups
        self.eos = tc.codec_eos_id
        self.dummy = num_slots
        self.scratch = config.max_len
        slots = num_slots + 1
        self.cache = talker.allocate_cache(slots, config.max_len + 1, dev, self.dtype)
        self.cp_cache = talker.code_predictor.allocate_cache(max_batch, dev, self.dtype)
        self.suppress = suppression_mask(tc.vocab_size, tc.control_id_start, tc.codec_eos_id, dev)
        h = tc.hidden_size
        # per-slot tables
        self.trail = torch.zeros(slots, config.max_trailing + 1, h, device=dev, dtype=self.dtype)
        self.trail_len = [0] * slots
        self.bounded = [True] * slots  # the slot's top_k settings fit the bounded sampler (host copy)
        self.last_codes = torch.zeros(slots, self.groups, dtype=torch.long, device=dev)
        self.seen = torch.zeros(slots, tc.vocab_size, dtype=torch.bool, device=dev)
        self.p_float = torch.ones(
            slots, 5, device=dev
        )  # temperature, top_p, rep penalty, sub temp, sub top_p
        self.p_int = torch.zeros(slots, 5, dtype=torch.long, device=dev)  # top_k, sub top_k, seed, min, end
        self.p_bool = torch.zeros(slots, 2, dtype=torch.bool, device=dev)  # greedy, sub greedy
        # static graph inputs / outputs
        mb = max_batch
        # slots, positions, text index, prompt-row flag (1: the row's input is d_embeds, a prompt position)
        self.d_meta = torch.zeros(4, mb, dtype=torch.long, device=dev)
        self.d_embeds = torch.zeros(mb, h, device=dev, dtype=self.dtype)
        self.d_hidden = torch.zeros(mb, h, device=dev, dtype=self.dtype)
        pr, pt = max(config.prefill_row_buckets), max(config.prefill_len_buckets)
        self.p_embeds = torch.zeros(pr, pt, h, device=dev, dtype=self.dtype)
        self.p_pos = torch.zeros(pr, pt, dtype=torch.long, device=dev)
        self.p_rows = torch.zeros(2, pr, dtype=torch.long, device=dev)  # slot, index of the last position
        self.p_hidden = torch.zeros(pr, h, device=dev, dtype=self.dtype)
        self.s_meta = torch.zeros(3, mb, dtype=torch.long, device=dev)  # slots, segment step, counter
        self.s_hidden = torch.zeros(mb, h, device=dev, dtype=self.dtype)
        self.s_codes = torch.zeros(mb, self.groups, dtype=torch.long, device=dev)
        self.s_true = torch.ones(mb, dtype=torch.bool, device=dev)
        self._reset_static_inputs()
        # codec
        self.codec_dummy = codec_slots  # padding rows of the later-chunk lane; the first lane's: +1
        codec.init_streams(codec_slots + 2)
        self.codec_batches = batch_buckets(self.max_codec_batch)
        self._codec_io: dict[tuple[int, int, bool], tuple[Tensor, Tensor, Tensor]] = {}
        cuda = dev.type == "cuda"
        if cuda:  # the Triton kernels are checked against torch before any graph is captured
            # Code2Wav's convolutions run the fused kernel, which needs no tuning; where it is off,
            # cuDNN autotunes each graph bucket's shapes while they are captured (its untuned picks
            # are far slower at the large buckets). The flag is the process's: a forced aligner
            # sharing the worker runs its convolutions on cuDNN's default picks, as
            # bench/gpu_aligner_bench.py measures it
            torch.backends.cudnn.benchmark = not fused_conv.check(dev)
            sampler.draw_kernel.check(dev)
            fused_norm.check(dev)
            fused_rope.check(dev)
            fused_layer.check(dev)
            window_attention.check(dev)
        defer = cuda if config.defer_codec is None else config.defer_codec
        self.defers_codec = bool(defer)
        # deferring on CUDA: first chunks replay on the first-chunk lane, beside the later chunks
        self.first_stream = torch.cuda.Stream(dev, priority=-16) if cuda and defer else None
        self._slots_ready: torch.cuda.Event | None = None  # the lane's resets and reference clips done
        self._deferred: Callable[[], tuple[dict[str, np.ndarray], list[tuple[str, int]]]] | None = None
        self.batches = batch_buckets(mb)
        # the decode attention kernel reads each row's own length: one graph per batch size
        self.decode_kernel = decode_attention.available(dev)
        kv_buckets = () if self.decode_kernel else config.kv_buckets
        self.kv_buckets = sorted({k for k in kv_buckets if k < config.max_len + 1} | {config.max_len + 1})
        self.graphs = GraphBank(dev, enabled=not config.enforce_eager)
        # the later chunks' Code2Wav graphs replay beside the first-chunk lane's (which live in the
        # talker's bank): the two must not share a memory pool, or one's temporaries overwrite the other's
        self.codec_graphs = GraphBank(dev, enabled=not config.enforce_eager)
        self.samples_per_frame = codec.samples_per_frame
        self._codec_primes: dict[int, Tensor] = {}  # codec slot -> reference codes to run through it
        # codec slots whose reference clip is given since their last reset: a prompt prefilled again
        # (a preemption before the first frame) must not run the clip through the slot a second time
        self._primed: set[int] = set()
        self.codec_states: CodecStateCache | None = (
            CodecStateCache(config.codec_state_cache_bytes) if config.codec_state_cache_bytes > 0 else None
        )
        self.figures = StageFigures(cuda)
        self._launches = 0  # Code2Wav graph replays (or eager calls) in this step
        self.prefix_cache: PrefixKVCache | None = None  # voices' prompt prefixes (engine.qwen3.prefix_cache)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        k = self.cache.k
        return 2 * k.shape[0] * k.shape[2] * k.shape[4] * k.element_size()

    @property
    def kv_bytes_per_stream(self) -> int:
        return self.kv_bytes_per_token * (self.config.max_len + 1)

    def _host(self, values: object, dtype: torch.dtype = torch.long) -> Tensor:
        """A host tensor to copy to the GPU with non_blocking=True: pinned, so the copy never waits
        for the stream's queued work (from pageable memory, copies over 64 KiB, such as a 64-row
        25-frame Code2Wav chunk's codes, wait for it: the host would stop planning while the GPU
        decodes). Pinned blocks come from PyTorch's host cache, reused only once their copy is done.
        Nested lists go through numpy, which converts a chunk's codes faster than torch.tensor."""
        host = torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]))
        return host.pin_memory() if self._pin else host

    def _to_device(self, values: list[int] | list[list[int]]) -> Tensor:
        """A small long tensor on the device without waiting for the GPU (a plain
        torch.tensor(..., device=cuda) blocks until the stream's queued work is done)."""
        return self._host(values).to(self.device, non_blocking=True)

    # -- prompts -------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, prompts: list[SegmentPrompt]) -> None:
        """Build the prompt embeddings of segments, all in one batch (a ValueError fails the batch).
        Runs at a step's start, on the step's stream."""
        todo = [p for p in prompts if p.embeds is None]
        for p in todo:
            assert p.tokens is not None, "segment prompt not tokenised"
        items = [
            PromptItem(
                p.tokens,
                speaker_embedding=p.speaker_embedding,
                ref_codes=p.ref_codes,
                non_streaming=p.non_streaming,
            )
            for p in todo
            if p.tokens is not None
        ]
        for p, embeds in zip(todo, self.prompt_builder.build(items), strict=True):
            p.embeds = embeds

    def prompt_length(self, prompt: SegmentPrompt) -> int:
        """A prepared segment's prompt length (ValueError: its text does not fit a slot's tables)."""
        assert prompt.embeds is not None, "segment prompt not prepared"
        n = prompt.embeds.trailing.shape[0]
        if n > self.config.max_trailing:
            raise ValueError(f"segment text too long: {n} text positions > {self.config.max_trailing}")
        return int(prompt.embeds.prefill.shape[0])

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, plan: StepPlan, while_waiting: Callable[[], None] | None = None) -> StepOutput:
        """Launch the plan's talker, sampling and Code2Wav work -> its codes and audio. `while_waiting`
        runs once the sampling is queued, before the host waits for its codes."""
        hidden: list[Tensor] = []
        meta: list[tuple[int, int, int]] = []  # per sampling row: slot, segment step, noise counter
        fig = self.figures
        # a reset slot starts afresh: a clip left for it by a step that failed is its last owner's
        for slot in plan.codec_resets:
            self._codec_primes.pop(slot, None)
        self._primed.difference_update(plan.codec_resets)
        if plan.prefix_copies:
            assert self.prefix_cache is not None, "prefix copies planned without a prefix cache"
            by_key: dict[str, list[int]] = defaultdict(list)  # one write per voice prefix
            for copy in plan.prefix_copies:
                by_key[copy.key].append(copy.kv_slot)
            for key, slots in by_key.items():
                self.prefix_cache.copy_into_slots(key, self.cache, self._to_device(slots))
        # one-position prefill chunks (typically what is left of a prompt after its voice prefix came
        # from the prefix cache) ride in the decode graph; the sampling ones first
        merged = sorted((c for c in plan.prefill if c.length == 1), key=lambda c: not c.samples_frame)
        longer = [c for c in plan.prefill if c.length > 1]
        sampling_merged = [c for c in merged if c.samples_frame]
        if plan.decode or merged:
            t = fig.start()
            h = self._decode(plan.decode, merged)
            hidden.append(h[: len(plan.decode) + len(sampling_merged)])
            meta += [(r.kv_slot, r.frame_index, r.utterance_frame * self.groups) for r in plan.decode]
            meta += [(c.kv_slot, c.frame_index, c.utterance_frame * self.groups) for c in sampling_merged]
            self._keep_prefixes(merged)
            fig.stop("decode", t)
            fig.rows("batch_decode", len(plan.decode) + len(merged))
        if longer:
            t = fig.start()
            h = self._prefill(longer)
            if h is not None:
                hidden.append(h)
                meta += [
                    (c.kv_slot, c.frame_index, c.utterance_frame * self.groups)
                    for c in longer
                    if c.samples_frame
                ]
            fig.stop("prefill", t)
        if plan.prefill:
            fig.rows("batch_prefill", len(plan.prefill))
            fig.rows("prefill_tokens", sum(c.length for c in plan.prefill))
        codes: list[Frame] = []
        sampled: _SampledCodes | None = None
        if meta:
            t = fig.start()
            sampled = self._sample(torch.cat(hidden) if len(hidden) > 1 else hidden[0], meta)
            fig.stop("sample", t)
            fig.rows("batch_sample", len(meta))
        self._launches = 0
        early = self._launch_later_early(plan) if self.first_stream is not None else None
        if while_waiting is not None:
            while_waiting()
        if sampled is not None:
            codes = self._read_codes(sampled)
            # rows were sampled decode, one-position prompts, longer prompts: back to the plan's order
            ran = [r.request_id for r in plan.decode] + [c.request_id for c in sampling_merged]
            ran += [c.request_id for c in longer if c.samples_frame]
            by_request = dict(zip(ran, codes, strict=True))
            codes = [by_request[rid] for rid in plan.sampling_rows]
        first = self._first_audio_chunks(plan, codes)
        codec = plan.codec + first
        audio, delivered = self._run_codec(plan, first, early)
        if codec:
            fig.rows("batch_codec", len(codec))
            fig.rows("codec_frames", sum(c.num_frames for c in codec))
            fig.rows("codec_launches", self._launches)
        fig.finish_step()
        return StepOutput(codes=codes, audio=audio, delivered=delivered)

    def _run_codec(
        self,
        plan: StepPlan,
        first: list[CodecChunk],
        early: Callable[[], dict[str, np.ndarray]] | None = None,
    ) -> tuple[dict[str, np.ndarray], list[tuple[str, int]] | None]:
        """Code2Wav after sampling -> this step's audio and, when deferring, the chunks it holds.

        Deferring, first chunks are decoded and collected now (time to first audio); the others are
        collected by the next step, so the host plans it while the GPU decodes them. `early`: the
        later chunks' collector when they were launched before the codes were read (first-chunk lane)."""
        later = [c for c in plan.codec if not c.first_chunk] if self.defers_codec else []
        now = [c for c in plan.codec if c.first_chunk] + first if self.defers_codec else plan.codec + first
        if early is not None:  # later chunks already queued on this stream: first chunks on their lane
            assert self.first_stream is not None
            collect_later = early
            with torch.cuda.stream(self.first_stream):
                collect_now = self._launch_codec(now, [], first_lane=True)
        else:
            t = self.figures.start()
            collect_now = self._launch_codec(now, plan.codec_resets)
            collect_later = self._launch_codec(later, [])
            if now or later:
                self.figures.stop("codec", t)
        if not self.defers_codec:
            return collect_now(), None
        audio: dict[str, np.ndarray] = {}
        delivered: list[tuple[str, int]] = []
        if self._deferred is not None:  # launched before this step's talker work: already done
            audio, delivered = self._deferred()
            self._deferred = None
        for rid, wav in collect_now().items():  # after the same stream's deferred chunk, if any
            audio[rid] = np.concatenate([audio[rid], wav]) if rid in audio else wav
        delivered += [(c.request_id, c.num_frames) for c in now]
        if later:
            self._deferred = lambda: (collect_later(), [(c.request_id, c.num_frames) for c in later])
        return audio, delivered

    def _launch_later_early(self, plan: StepPlan) -> Callable[[], dict[str, np.ndarray]]:
        """The slots' resets and the later chunks, on this stream right behind the sampling: the GPU
        decodes them while the host reads the codes and builds the first chunks (first-chunk lane)."""
        later = [c for c in plan.codec if not c.first_chunk]
        t = self.figures.start()
        collect = self._launch_codec(later, plan.codec_resets)
        if later:
            self.figures.stop("codec", t)
        return collect

    def _first_audio_chunks(self, plan: StepPlan, codes: list[Frame]) -> list[CodecChunk]:
        """One-frame chunks of the frames this step sampled that are decoded in it: requests' first
        frames and frames whose listener runs low (plan.first_audio_now; EOS gives none)."""
        if not plan.first_audio_now:
            return []
        row = {rid: i for i, rid in enumerate(plan.sampling_rows)}
        return [
            CodecChunk(
                request_id=f.request_id,
                codec_slot=f.codec_slot,
                first_frame=f.frame,
                codes=[codes[row[f.request_id]]],
                first_chunk=f.frame == 0,
            )
            for f in plan.first_audio_now
            if codes[row[f.request_id]][0] != self.eos
        ]

    # -- talker decode -------------------------------------------------------------------------
    def _decode(self, rows: list[DecodeRow], prompt_rows: list[PrefillChunk]) -> Tensor:
        """Decode rows, then one-position prompt chunks, through one decode graph -> hidden [n, H]."""
        n = len(rows) + len(prompt_rows)
        b = bucket_for(n, self.batches)
        assert b is not None, f"{n} decode rows exceed max_batch"
        top = max([r.position for r in rows] + [c.start for c in prompt_rows]) + 1
        k = bucket_for(top, self.kv_buckets) or self.kv_buckets[-1]
        pad = b - n
        meta = [
            [r.kv_slot for r in rows] + [c.kv_slot for c in prompt_rows] + [self.dummy] * pad,
            [r.position for r in rows] + [c.start for c in prompt_rows] + [self.scratch] * pad,
            [min(r.frame_index - 1, self.trail_len[r.kv_slot]) for r in rows] + [0] * (b - len(rows)),
            [0] * len(rows) + [1] * len(prompt_rows) + [0] * pad,
        ]
        if prompt_rows:
            for c in prompt_rows:
                if c.start == c.copied:
                    self._setup_slot(c)
            embeds = torch.stack([self._context(c)[c.start] for c in prompt_rows])
            self.d_embeds[len(rows) : n].copy_(embeds)
        self.d_meta[:, :b].copy_(self._host(meta), non_blocking=True)
        self.graphs.run(("decode", b, k), self._decode_fn(b, k))
        return self.d_hidden[:n]

    def _decode_fn(self, b: int, k: int) -> Callable[[], None]:
        def fn() -> None:
            slots, positions, text_index = self.d_meta[0, :b], self.d_meta[1, :b], self.d_meta[2, :b]
            embeds = self.talker.frame_embedding(self.last_codes[slots]) + self.trail[slots, text_index]
            embeds = torch.where(self.d_meta[3, :b, None].bool(), self.d_embeds[:b], embeds)
            lengths = None
            if self.decode_kernel:  # padded rows (the dummy slot) read one position, not the whole slot
                lengths = torch.where(slots == self.dummy, 1, positions + 1).to(
                    torch.int32
                )  # once, not per layer
            out = self.talker(embeds[:, None], positions[:, None], self.cache, slots, k, lengths)
            self.d_hidden[:b].copy_(out[:, 0])

        return fn

    # -- talker prefill ------------------------------------------------------------------------
    def _prefill(self, chunks: list[PrefillChunk]) -> Tensor | None:
        """Prompt chunks -> the hidden states of the chunks that complete their context."""
        rows = []
        for c in chunks:
            if c.start == c.copied:  # the slot's first chunk (after a prefix taken from the cache)
                self._setup_slot(c)
            rows.append(self._context(c)[c.start : c.start + c.length])
        cfg = self.config
        r = bucket_for(len(chunks), sorted(cfg.prefill_row_buckets))
        t = bucket_for(max(c.length for c in chunks), sorted(cfg.prefill_len_buckets))
        if r is None or t is None:
            out = self._prefill_eager(chunks, rows)
        else:
            out = self._prefill_bucket(chunks, rows, r, t)
        self._keep_prefixes(chunks)
        sampling = [i for i, c in enumerate(chunks) if c.samples_frame]
        if not sampling:
            return None
        return (
            out[: len(sampling)] if sampling == list(range(len(sampling))) else out[self._to_device(sampling)]
        )

    def _prefill_bucket(self, chunks: list[PrefillChunk], rows: list[Tensor], r: int, t: int) -> Tensor:
        """Padded into the (r rows, t positions) buffers and run as that bucket's graph; padding
        positions go to the slot's scratch cell, padding rows to the dummy slot."""
        self.p_embeds[:r, :t].zero_()
        for i, row in enumerate(rows):
            self.p_embeds[i, : row.shape[0]].copy_(row)
        pos = [list(range(c.start, c.start + c.length)) + [self.scratch] * (t - c.length) for c in chunks]
        pos += [[self.scratch] * t] * (r - len(chunks))
        meta = [
            [c.kv_slot for c in chunks] + [self.dummy] * (r - len(chunks)),
            [c.length - 1 for c in chunks] + [0] * (r - len(chunks)),
        ]
        self.p_pos[:r, :t].copy_(self._host(pos), non_blocking=True)
        self.p_rows[:, :r].copy_(self._host(meta), non_blocking=True)
        self.graphs.run(("prefill", r, t), self._prefill_fn(r, t))
        return self.p_hidden[: len(chunks)]

    def _prefill_fn(self, r: int, t: int) -> Callable[[], None]:
        kv_len = self.config.max_len + 1  # static: the mask bounds what each position sees

        def fn() -> None:
            slots, last = self.p_rows[0, :r], self.p_rows[1, :r]
            out = self.talker(self.p_embeds[:r, :t], self.p_pos[:r, :t], self.cache, slots, kv_len)
            self.p_hidden[:r].copy_(out[torch.arange(r, device=out.device), last])

        return fn

    def _prefill_eager(self, chunks: list[PrefillChunk], rows: list[Tensor]) -> Tensor:
        t = max(c.length for c in chunks)
        pos = [list(range(c.start, c.start + c.length)) + [self.scratch] * (t - c.length) for c in chunks]
        embeds = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        pos_t = self._to_device(pos)
        slots = self._to_device([c.kv_slot for c in chunks])
        kv_len = max(c.start + c.length for c in chunks)
        out = self.talker(embeds, pos_t, self.cache, slots, kv_len)
        return torch.stack([out[i, c.length - 1] for i, c in enumerate(chunks)])

    def _keep_prefixes(self, chunks: list[PrefillChunk]) -> None:
        """Store the prompt prefixes this step's chunks computed in full (first request of a voice)."""
        if self.prefix_cache is None:
            return
        for c in chunks:
            done = c.copied == 0 and c.start < c.prefix_len <= c.start + c.length
            if c.prefix_key is not None and done and c.prefix_key not in self.prefix_cache:
                self.prefix_cache.store(c.prefix_key, self.cache, c.kv_slot, c.prefix_len)

    def _context(self, c: PrefillChunk) -> Tensor:
        """The segment's talker inputs: the prompt, then (on a resume) the generated frames."""
        prompt = c.payload.embeds
        assert prompt is not None, "segment prompt not prepared"
        ctx = prompt.prefill.to(self.dtype)
        if c.codes and c.start + c.length > c.prompt_len:
            codes = self._to_device(c.codes)
            index = torch.clamp(torch.arange(len(c.codes), device=self.device), max=self.trail_len[c.kv_slot])
            frames = self.talker.frame_embedding(codes) + self.trail[c.kv_slot, index]
            ctx = torch.cat((ctx, frames))
        return ctx

    def _setup_slot(self, c: PrefillChunk) -> None:
        """Fill a slot's tables at the start of a segment (or of a resume after preemption)."""
        slot, prompt, s = c.kv_slot, c.payload.embeds, c.sampling
        if (
            c.payload.ref_codes is not None
            and c.utterance_frame == 0
            and not c.codes
            and c.codec_slot not in self._primed
        ):
            # an in-context clone's audio continues its reference clip, as upstream decodes
            # reference + generated codes and cuts the reference off: prime the codec state with it
            self._codec_primes[c.codec_slot] = c.payload.ref_codes
            self._primed.add(c.codec_slot)
        n = prompt.trailing.shape[0]
        self.trail[slot, :n] = prompt.trailing.to(self.dtype)
        self.trail[slot, n] = prompt.tts_pad.to(self.dtype)
        self.trail_len[slot] = n
        floats = [s.temperature, s.top_p, s.repetition_penalty, s.sub_temperature, s.sub_top_p]
        forced = c.payload.forced_frames
        min_new, end_at = (forced, forced) if forced is not None else (s.min_new_tokens, s.end_at)
        ints = [s.top_k, s.sub_top_k, s.seed & SEED_MASK, min_new, end_at]
        self.p_float[slot].copy_(self._host(floats, torch.float32), non_blocking=True)
        self.p_int[slot].copy_(self._host(ints), non_blocking=True)
        self.p_bool[slot].copy_(self._host([s.greedy, s.sub_greedy], torch.bool), non_blocking=True)
        self.bounded[slot] = top_k_within_bound(s.top_k, s.greedy) and top_k_within_bound(
            s.sub_top_k, s.sub_greedy
        )
        self.seen[slot] = False
        if c.codes:
            first = self._to_device([f[0] for f in c.codes])
            self.seen[slot, first] = True

    # -- sampling + code predictor -------------------------------------------------------------
    def _sample(self, hidden: Tensor, meta: list[tuple[int, int, int]]) -> _SampledCodes:
        n = len(meta)
        b = bucket_for(n, self.batches)
        assert b is not None, f"{n} sampling rows exceed max_batch"
        cols = list(zip(*meta, strict=True))
        pad = b - n
        host = [list(cols[0]) + [self.dummy] * pad, list(cols[1]) + [0] * pad, list(cols[2]) + [0] * pad]
        self.s_meta[:, :b].copy_(self._host(host), non_blocking=True)
        self.s_hidden[:n].copy_(hidden)
        bounded = all(self.bounded[slot] for slot in cols[0])
        self.graphs.run(("sample", b, bounded), self._sample_fn(b, bounded))
        if self.device.type != "cuda":
            return _SampledCodes(self.s_codes[:n].clone(), None)
        host = torch.empty((n, self.groups), dtype=torch.long, pin_memory=True)
        host.copy_(self.s_codes[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _SampledCodes(host, done)

    def _read_codes(self, sampled: _SampledCodes) -> list[Frame]:
        """The step's one host read of sampled codes: waits for the sampling only, not for work
        queued behind it. One tuple per row (engine.qwen3.plan.Frame)."""
        if sampled.done is not None:
            sampled.done.synchronize()
        return list(map(tuple, sampled.host.tolist()))

    def _sample_fn(self, b: int, bounded: bool) -> Callable[[], None]:
        def fn() -> None:
            slots, step, counter = self.s_meta[0, :b], self.s_meta[1, :b], self.s_meta[2, :b]
            hidden = self.s_hidden[:b]
            pf, pi, pb = self.p_float[slots], self.p_int[slots], self.p_bool[slots]
            seed = pi[:, 2]
            logits = mask_talker_logits(
                self.talker.logits(hidden),
                step=step,
                seen=self.seen[slots],
                repetition_penalty=pf[:, 2],
                suppress=self.suppress,
                eos_id=self.eos,
                min_new_tokens=pi[:, 3],
                end_at=pi[:, 4],
            )
            talker_params = SamplingParams(
                temperature=pf[:, 0], top_k=pi[:, 0], top_p=pf[:, 1], greedy=pb[:, 0]
            )
            first = sample(logits, talker_params, seed, counter, bounded)
            # a device-side True: a Python scalar would be a host copy, illegal inside a graph
            self.seen.index_put_((slots, first), self.s_true[:b])
            sub = SamplingParams(temperature=pf[:, 3], top_k=pi[:, 1], top_p=pf[:, 4], greedy=pb[:, 1])
            codes = self.talker.predict_codes(hidden, first, sub, seed, counter, self.cp_cache, bounded)
            self.last_codes[slots] = codes
            self.s_codes[:b].copy_(codes)

        return fn

    # -- Code2Wav ------------------------------------------------------------------------------
    def _codec_buffers(self, b: int, f: int, first_lane: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        key = (b, f, first_lane)
        if key not in self._codec_io:
            dummy = self.codec_dummy + int(first_lane)
            slots = torch.full((b,), dummy, dtype=torch.long, device=self.device)
            codes = torch.zeros(b, f, self.groups, dtype=torch.long, device=self.device)
            out = torch.zeros(b, f * self.samples_per_frame, device=self.device, dtype=torch.int16)
            self._codec_io[key] = (slots, codes, out)
        return self._codec_io[key]

    def _codec_fn(self, b: int, f: int, first_lane: bool = False) -> Callable[[], None]:
        slots, codes, out = self._codec_buffers(b, f, first_lane)

        def fn() -> None:
            out.copy_(_pcm16(self.codec.decode_step(slots, codes)))

        return fn

    def _launch_codec(
        self, chunks: list[CodecChunk], resets: list[int], first_lane: bool = False
    ) -> Callable[[], dict[str, np.ndarray]]:
        """Launch chunks (after resets and pending reference clips) on the current stream -> a
        function that waits for their audio. first_lane: through the first-chunk graphs, after the
        slots' resets on the talker's stream."""
        if not chunks and not resets and (first_lane or not self._codec_primes):
            return dict
        host: list[tuple[list[CodecChunk], Tensor]] = []
        if first_lane:
            if self._slots_ready is not None:
                # only the slots' resets must come first: a stream's earlier chunks are done (queued
                # before this step's sampling, whose codes the host has read), and the step's later
                # chunks are other streams'
                torch.cuda.current_stream(self.device).wait_event(self._slots_ready)
        else:
            if resets:
                self.codec.reset(self._to_device(resets))
            self._prime_codec()
            if self.first_stream is not None:
                self._slots_ready = torch.cuda.Event()
                self._slots_ready.record()
        by_frames: dict[int, list[CodecChunk]] = defaultdict(list)
        for c in chunks:
            by_frames[c.num_frames].append(c)
        for group in by_frames.values():
            for part in _slices(len(group), self.max_codec_batch):
                rows = group[part]
                wav = self._decode_codec(rows, first_lane)
                # copied out before the next replay of the same bucket overwrites its output
                host.append((rows, wav.to("cpu", non_blocking=True, copy=True)))
        done = torch.cuda.Event() if self.device.type == "cuda" else None
        if done is not None:  # the copies above are asynchronous: collect() waits for them
            done.record()

        def collect() -> dict[str, np.ndarray]:
            if done is not None:
                done.synchronize()
            audio: dict[str, np.ndarray] = {}
            for rows, wav in host:
                arr = wav.numpy()
                for i, c in enumerate(rows):
                    audio[c.request_id] = arr[i]
            return audio

        return collect

    def _prime_codec(self) -> None:
        """Run pending reference clips through their slots' decoder state (the audio is dropped).
        A clip already run for an earlier request has its end state copied from the cache instead;
        the others run once each, batched by length through the graph buckets."""
        if not self._codec_primes:
            return
        clips: dict[int, tuple[Tensor, list[int]]] = {}
        for slot, codes in self._codec_primes.items():
            clips.setdefault(id(codes), (codes, []))[1].append(slot)
        self._codec_primes.clear()
        by_length: dict[int, list[tuple[Tensor, list[int]]]] = defaultdict(list)
        for codes, slots in clips.values():
            state = self.codec_states.lookup(codes) if self.codec_states is not None else None
            if state is not None:
                self.codec.load_slot_state(self._to_device(slots), state)
            else:
                by_length[int(codes.shape[0])].append((codes, slots))
        for group in by_length.values():
            for part in _slices(len(group), self.max_codec_batch):
                rows = group[part]
                codes = torch.stack([c.to(self.device, torch.long, non_blocking=True) for c, _ in rows])
                self._run_frames([slots[0] for _, slots in rows], codes)
                for clip, slots in rows:
                    state = self.codec.slot_state(slots[0])
                    if len(slots) > 1:
                        self.codec.load_slot_state(self._to_device(slots[1:]), state)
                    if self.codec_states is not None:
                        self.codec_states.store(clip, state)

    def _run_frames(self, slots: list[int], codes: Tensor) -> None:
        """Advance the slots through codes [B, F, Q], output dropped: in chunks of the captured
        sizes (graph replays), else eagerly in chunks of EAGER_CHUNK_FRAMES."""
        b = bucket_for(len(slots), self.codec_batches) or len(slots)
        captured = [f for f in self.codec_frame_buckets if ("codec", b, f) in self.codec_graphs.graphs]
        start, total = 0, int(codes.shape[1])
        while start < total:
            left = total - start
            f = max((f for f in captured if f <= left), default=min(left, EAGER_CHUNK_FRAMES))
            self._decode_frames(slots, codes[:, start : start + f])
            start += f

    def _decode_codec(self, rows: list[CodecChunk], first_lane: bool = False) -> Tensor:
        return self._decode_frames(
            [c.codec_slot for c in rows], self._host([c.codes for c in rows]), first_lane
        )

    def _decode_frames(self, slot_list: list[int], codes: Tensor, first_lane: bool = False) -> Tensor:
        """Decode codes [n, F, Q] (host or device) into the n slots, through the lane's (bucket, F)
        graph when there is one; the result may be that graph's static output."""
        n, f = len(slot_list), int(codes.shape[1])
        b = bucket_for(n, self.codec_batches) or n
        self._launches += 1
        bank, key = (
            (self.graphs, ("codec_first", b, f)) if first_lane else (self.codec_graphs, ("codec", b, f))
        )
        if key not in bank.graphs:
            return _pcm16(
                self.codec.decode_step(self._to_device(slot_list), codes.to(self.device, non_blocking=True))
            )
        slots_buf, codes_buf, out = self._codec_buffers(b, f, first_lane)
        dummy = self.codec_dummy + int(first_lane)
        slots_buf.copy_(self._host(slot_list + [dummy] * (b - n)), non_blocking=True)
        codes_buf[:n].copy_(codes, non_blocking=True)
        t = self.figures.mark()
        bank.run(key, self._codec_fn(b, f, first_lane))
        self.figures.span("codec_replays", t)
        return out[:n]

    # -- start-up ------------------------------------------------------------------------------
    def _reset_static_inputs(self) -> None:
        self.d_meta[0].fill_(self.dummy)
        self.d_meta[1].fill_(self.scratch)
        self.d_meta[2:].zero_()
        self.p_pos.fill_(self.scratch)
        self.p_rows[0].fill_(self.dummy)
        self.p_rows[1].zero_()
        self.s_meta[0].fill_(self.dummy)
        self.s_meta[1:].zero_()

    def graph_keys(self) -> list[tuple[object, ...]]:
        """Every graph, largest first within each kind."""
        keys: list[tuple[object, ...]] = []
        keys += [("decode", b, k) for b in reversed(self.batches) for k in reversed(self.kv_buckets)]
        keys += [("sample", b, bounded) for bounded in (True, False) for b in reversed(self.batches)]
        keys += [
            ("prefill", r, t)
            for r in sorted(self.config.prefill_row_buckets, reverse=True)
            for t in sorted(self.config.prefill_len_buckets, reverse=True)
        ]
        keys += [
            ("codec", b, f)
            for b in reversed(self.codec_batches)
            for f in sorted(self.codec_frame_buckets, reverse=True)
        ]
        if self.first_stream is not None:
            first = sorted(set(FIRST_LANE_FRAMES) & set(self.codec_frame_buckets), reverse=True)
            keys += [("codec_first", b, f) for b in reversed(self.codec_batches) for f in first]
        return keys

    def fuse_layers(self) -> None:
        """The talker's and the code predictor's layers on the fused kernels (CUDA bf16, once)."""
        if not (self.config.fused_layers and self.device.type == "cuda" and self.dtype == torch.bfloat16):
            return
        for stack in (self.talker.model, self.talker.code_predictor.model):
            if not stack.fused:
                stack.fuse_layers()

    @torch.no_grad()
    def capture(self, progress: Callable[[int, int, object], None] | None = None) -> int:
        """Capture all graphs (no-op when eager or on CPU); returns the number captured. First the
        decoder layers are fused (RunnerConfig.fused_layers), eager or not."""
        self.fuse_layers()
        if not self.graphs.enabled:
            return 0
        keys = self.graph_keys()
        for i, key in enumerate(keys):
            self._reset_static_inputs()
            if key[0] == "decode":
                fn = self._decode_fn(int(key[1]), int(key[2]))  # type: ignore[call-overload]
            elif key[0] == "sample":
                fn = self._sample_fn(int(key[1]), bool(key[2]))  # type: ignore[call-overload]
            elif key[0] == "prefill":
                fn = self._prefill_fn(int(key[1]), int(key[2]))  # type: ignore[call-overload]
            else:
                fn = self._codec_fn(int(key[1]), int(key[2]), key[0] == "codec_first")  # type: ignore[call-overload]
            bank = self.codec_graphs if key[0] == "codec" else self.graphs
            bank.capture(key, fn)
            if progress is not None:
                progress(i + 1, len(keys), key)
        torch.cuda.synchronize(self.device)
        return len(self.graphs) + len(self.codec_graphs)


def capture_with_progress(runner: Runner) -> int:
    """Capture the runner's graphs behind a rich progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("capturing CUDA graphs"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    ) as bar:
        task = bar.add_task("", total=len(runner.graph_keys()))

        def step(done: int, total: int, key: object) -> None:
            bar.update(task, completed=done, description=str(key))

        return runner.capture(step)
