"""`Qwen3Engine`: engine.api.Engine over the scheduler, the step loop and the GPU runner.

Each text segment becomes its own talker sequence; the frames of all segments of an utterance run
through one Code2Wav stream, so the audio continues across segments. Segments are synthesised back
to back on the same talker slot, so the next segment's first audio is ready long before the
previous one's last packet is due (generation runs many times faster than real time).
Word timings are estimates: each segment's words spread over its frames by character count.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from engine.api import (
    AdmissionFigures,
    AudioChunk,
    ChunkListener,
    EngineError,
    EngineInfo,
    EngineLoad,
    InvalidAudio,
    InvalidRequest,
    Overloaded,
    QueuePosition,
    SynthesisRequest,
    SynthesisStream,
    TextSegment,
    UnknownVoice,
    WordTiming,
)
from engine.bridge import ChunkBatch, ChunkChannel
from engine.qwen3.core import EngineCore
from engine.qwen3.kv_cache import KVCacheLayout, KVCacheManager, talker_kv_bytes_per_token
from engine.qwen3.models.codec import Code2Wav
from engine.qwen3.models.config import GenerationDefaults, Qwen3TTSConfig
from engine.qwen3.models.sampler import SEED_MASK
from engine.qwen3.models.talker import Talker
from engine.qwen3.plan import RequestOutput
from engine.qwen3.prefix_cache import PrefixKVCache, prefix_key, prefix_length
from engine.qwen3.prompts import PromptRequest, tokenize_request
from engine.qwen3.reference_audio import prepare_reference_audio
from engine.qwen3.request import SAMPLE_RATE, SAMPLES_PER_FRAME, Request, RequestStatus, Segment
from engine.qwen3.runner import RowSampling, Runner, RunnerConfig, SegmentPrompt, capture_with_progress
from engine.qwen3.scheduler import Scheduler, SchedulerConfig
from engine.qwen3.tokenizer import TextTokenizer
from engine.qwen3.voice_cache import VoicePromptCache


@dataclass(slots=True)
class Qwen3EngineConfig:
    """The engine's settings: the scheduler's and the runner's, each owned by its own config, and
    the engine's own. The sizes the two share (streams, batch, chunk sizes) are the scheduler's;
    the runner is built with them."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    kv_slots: int | None = None  # talker slots; None: from kv_budget_bytes (capped at the streams)
    kv_budget_bytes: int = 8 << 30
    non_streaming_text: bool = False  # whole segment text in the prompt instead of one token per frame
    # voices' text-independent prompt prefixes kept as talker KV (engine.qwen3.prefix_cache); 0 turns it off
    prefix_cache_bytes: int = 256 << 20
    default_voice: str | None = None
    progress_bar: bool = True

    @property
    def max_streams(self) -> int:
        """Concurrent utterances (Code2Wav rows); more queue, then Overloaded."""
        return self.scheduler.codec_slots


def estimate_words(segment: Segment) -> list[WordTiming]:
    """Spread a finished segment's words over its frames in proportion to their characters."""
    text = segment.text.text
    start = segment.first_frame * SAMPLES_PER_FRAME
    total = segment.frames * SAMPLES_PER_FRAME
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        j = i
        while j < len(text) and not text[j].isspace():
            j += 1
        spans.append((i, j))
        i = j
    if not spans or total <= 0:
        return []
    chars = sum(b - a for a, b in spans)
    words, done = [], 0
    for a, b in spans:
        s0 = start + total * done // chars
        done += b - a
        s1 = start + total * done // chars
        words.append(
            WordTiming(
                text=text[a:b],
                start_sample=s0,
                end_sample=s1,
                char_start=segment.text.source_offset(a),
                char_end=segment.text.source_offset(b),
                source="estimate",
            )
        )
    return words


@dataclass
class _Voice:
    speaker: str | None = None  # preset speaker (CustomVoice)
    speaker_embedding: torch.Tensor | None = None  # Base x-vector
    ref_codes: torch.Tensor | None = None  # Base ICL reference frames
    ref_text: str | None = None
    clip: npt.NDArray[np.float32] | None = (
        None  # a one-off clip (24 kHz), turned into a prompt on the step thread
    )


def share_frames(total: int, segments: list[TextSegment]) -> list[int]:
    """Split a forced frame count among segments in proportion to their characters (each >= 1,
    summing to `total` when total >= len(segments))."""
    chars = [max(1, len(seg.text.strip())) for seg in segments]
    spare = max(0, total - len(segments))  # every segment gets one frame, the rest by characters
    bounds = [round(spare * sum(chars[: i + 1]) / sum(chars)) for i in range(len(chars))]
    return [1 + b - a for a, b in zip([0, *bounds[:-1]], bounds, strict=True)]


class Qwen3Stream(SynthesisStream):
    def __init__(
        self, engine: Qwen3Engine, request: SynthesisRequest, voice: _Voice, channel: ChunkChannel
    ) -> None:
        self.request_id = request.request_id
        self._engine = engine
        self._request = request
        self._voice = voice
        self.channel = channel
        self.pending_words: list[WordTiming] = []
        self.samples_sent = 0
        self._closed = False
        # a forced length (benchmarks) is the utterance's total: its segments are held until the text
        # is closed, then the frames are shared among them by characters
        self._held: list[TextSegment] | None = [] if request.forced_frames is not None else None
        self.ticket: Any = None  # its engine.admission.Ticket (set by the engine's open)

    def push(self, segment: TextSegment) -> None:
        if self._closed:
            raise InvalidRequest("text already closed")
        if not segment.text.strip():
            return
        if self._held is not None:
            self._held.append(segment)
        else:
            self._engine._push(self, segment)

    def close_text(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._held:
            total = self._request.forced_frames or 0
            for segment, frames in zip(self._held, share_frames(total, self._held), strict=True):
                self._engine._push(self, segment, forced_frames=frames)
        self._engine.core.close_text(self.request_id)

    def cancel(self) -> None:
        self._engine.core.abort(self.request_id)

    def listen(self, listener: ChunkListener) -> bool:
        self.channel.listen(listener)
        return True

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self.channel.__aiter__()

    def queue_position(self) -> QueuePosition | None:
        ticket = self.ticket
        if ticket is None or not ticket.queued:
            return None
        return self._engine.core.run_locked(lambda s: s.admission.position(ticket))  # type: ignore[return-value]

    def queue_wait_s(self) -> float:
        return 0.0 if self.ticket is None else float(self.ticket.waited_s)


class Qwen3Engine:
    def __init__(
        self,
        config: Qwen3TTSConfig,
        generation: GenerationDefaults,
        tokenizer: TextTokenizer,
        talker: Talker,
        codec: Code2Wav,
        engine_config: Qwen3EngineConfig | None = None,
        model_name: str = "qwen3-tts",
        speaker_encoder: Any | None = None,
        speech_tokenizer: Any | None = None,
    ) -> None:
        self.cfg = config
        self.generation = generation
        self.tokenizer = tokenizer
        self.talker = talker
        self.codec = codec
        self.speaker_encoder = speaker_encoder
        self.speech_tokenizer = speech_tokenizer
        self.econfig = ec = engine_config or Qwen3EngineConfig()
        speakers = tuple(config.speakers)
        default = ec.default_voice or (speakers[0] if speakers else None)
        self.info = EngineInfo(
            name="qwen3",
            model=model_name,
            sample_rate=SAMPLE_RATE,
            voices=speakers,
            languages=tuple(config.languages),
            default_voice=default,
        )
        self._voices: dict[str, _Voice] = {}
        # speaker embeddings and reference codes by clip content (one-off clips) and by voice id
        self.voice_cache = (
            VoicePromptCache.for_models(speaker_encoder, speech_tokenizer)
            if speaker_encoder is not None and config.tts_model_type == "base"
            else None
        )
        self._pending_prompts: dict[int, tuple[TextSegment, SynthesisRequest, _Voice]] = {}
        self._streams: dict[str, Qwen3Stream] = {}
        shape = config.talker.shape
        bytes_per_token = talker_kv_bytes_per_token(
            shape.num_hidden_layers,
            shape.num_key_value_heads,
            shape.head_dim,
            talker.codec_head.weight.element_size(),
        )
        sc, max_len = ec.scheduler, ec.runner.max_len
        if ec.kv_slots is not None:
            layout = KVCacheLayout(ec.kv_slots, max_len, bytes_per_token)
        else:
            layout = KVCacheLayout.from_budget(
                ec.kv_budget_bytes, bytes_per_token, max_len + 1, sc.codec_slots or None
            )
            layout = KVCacheLayout(layout.num_slots, max_len, bytes_per_token)
        sc = sc.sized(layout.num_slots)
        self.econfig = ec = replace(ec, scheduler=sc)  # its sizes as built
        self.runner = Runner(
            talker,
            codec,
            config,
            ec.runner,
            num_slots=layout.num_slots,
            codec_slots=sc.codec_slots,
            max_batch=sc.max_batch,
            codec_frame_buckets=sc.codec_frame_buckets,
        )
        self.scheduler = Scheduler(
            sc,
            KVCacheManager(layout),
            eos_code=config.talker.codec_eos_id,
            codec_delivery_steps=int(self.runner.defers_codec),
        )
        self.model_name = model_name
        self.prefix_cache = PrefixKVCache(ec.prefix_cache_bytes) if ec.prefix_cache_bytes > 0 else None
        if self.prefix_cache is not None:
            self.runner.prefix_cache = self.prefix_cache
            self.scheduler.prefix_lookup = self.prefix_cache.lookup
        self.core = EngineCore(self.scheduler, self.runner, self._on_outputs, prepare_batch=self._prepare)
        self.codec_state_bytes = float(self.codec.state_bytes_per_slot())  # fixed once the slots exist
        self._ready = False

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        engine_config: Qwen3EngineConfig | None = None,
    ) -> Qwen3Engine:
        from engine.qwen3.loader import load_qwen3_tts

        b = load_qwen3_tts(path, device, dtype)
        if b.speech_tokenizer is None:
            raise EngineError("the speech tokenizer (Code2Wav) could not be loaded")
        return cls(
            b.config,
            b.generation,
            b.tokenizer,
            b.talker,
            b.speech_tokenizer.decoder,
            engine_config,
            model_name=Path(path).name,
            speaker_encoder=b.speaker_encoder,
            speech_tokenizer=b.speech_tokenizer,
        )

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.econfig.progress_bar and self.runner.graphs.enabled:
            await asyncio.to_thread(capture_with_progress, self.runner)
        else:
            await asyncio.to_thread(self.runner.capture)
        self.core.start()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False
        for rid in list(self._streams):
            self.core.abort(rid)
        await asyncio.to_thread(self._drain_and_stop)

    def _drain_and_stop(self) -> None:
        if self.core.running:
            self.core.stop()
        for stream in list(self._streams.values()):
            stream.channel.finish()
        self._streams.clear()

    def load(self) -> EngineLoad:
        def snapshot(s: Scheduler) -> tuple[int, int, dict[str, float], AdmissionFigures]:
            figures = s.kv.stats()
            ttfa = s.ttfa_p50_s()
            if ttfa is not None:
                figures["ttfa_p50_ms"] = (
                    1000 * ttfa
                )  # engine side: arrival to first decoded chunk, last minute
            figures["ttfa_samples"] = float(s.ttfa_samples)
            figures["requests_finished"] = float(s.finished)
            figures.update(s.leads.snapshot(s.clock()))
            figures.update(s.capacity.figures(len(s.admission.admitted), s.config.codec_slots))
            return s.num_active, s.num_queued, figures, s.admission.figures()

        active, queued, kv, admission = self.core.run_locked(snapshot)  # type: ignore[misc]
        extra = dict(kv)
        extra["active_streams"] = float(active)
        extra["queued_requests"] = float(queued)
        extra["kv_blocks_in_use"] = kv["kv_slots_used"]  # a block is one slot of max_len positions
        extra["kv_blocks_total"] = kv["kv_slots"]
        extra.update(self.runner.figures.snapshot())
        if self.prefix_cache is not None:
            extra.update(self.prefix_cache.stats())
        if self.runner.codec_states is not None:
            extra.update(self.runner.codec_states.stats())
        extra["kv_bytes_per_stream"] = float(self.runner.kv_bytes_per_stream)
        extra["codec_state_bytes_per_stream"] = self.codec_state_bytes
        extra["step_time_ms"] = 1000 * self.scheduler.step_time_s  # step to step
        extra["step_busy_ms"] = 1000 * self.scheduler.step_busy_s  # planning to results
        if self.runner.device.type == "cuda":
            extra["gpu_memory_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.runner.device))
            extra["gpu_memory_bytes"] = float(torch.cuda.memory_allocated(self.runner.device))
        return EngineLoad(
            active=active,
            queued=queued,
            capacity=admission.capacity,
            queue_limit=admission.queue_limit,
            ready=self._ready,
            extra=extra,
            admission=admission,
        )

    # -- requests ------------------------------------------------------------------------------
    def _resolve_voice(self, request: SynthesisRequest) -> _Voice:
        if request.ref_audio is not None:
            if self.voice_cache is None:
                raise InvalidRequest(
                    "voice cloning needs a Base model (this checkpoint has no speaker encoder)"
                )
            audio, rate = request.ref_audio
            return _Voice(clip=prepare_reference_audio(audio, rate), ref_text=request.ref_text)
        name = request.voice or self.info.default_voice
        if name is None:
            return _Voice()
        if name in self._voices:
            return self._voices[name]
        if name.lower() in self.cfg.talker.speaker_ids:
            return _Voice(speaker=name)
        raise UnknownVoice(f"unknown voice {name!r}")

    def _sampling(self, request: SynthesisRequest) -> RowSampling:
        g = self.generation
        seed = random.getrandbits(63) if request.seed is None else request.seed & SEED_MASK
        greedy = request.greedy or not g.do_sample
        return RowSampling(
            seed=seed,
            greedy=greedy,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            repetition_penalty=g.repetition_penalty,
            sub_greedy=request.greedy or not g.subtalker_do_sample,
            sub_temperature=g.subtalker_temperature,
            sub_top_k=g.subtalker_top_k,
            sub_top_p=g.subtalker_top_p,
            min_new_tokens=g.min_new_tokens,
            end_at=self._max_frames(request),
        )

    def _max_frames(self, request: SynthesisRequest) -> int:
        if request.forced_frames is not None:
            return request.forced_frames
        if request.max_frames is not None:
            return request.max_frames
        return max(1, self.generation.max_new_tokens - 1)

    def open(self, request: SynthesisRequest) -> Qwen3Stream:
        if not self._ready:
            raise EngineError("engine not started")
        if request.speed != 1.0:
            raise InvalidRequest("speed must be 1.0")
        if request.request_id in self._streams:
            raise InvalidRequest(f"duplicate request id {request.request_id!r}")
        lang = (request.language or "auto").lower()
        if lang not in self.cfg.languages:
            raise InvalidRequest(
                f"unsupported language {request.language!r}; this model speaks {', '.join(self.info.languages)}"
            )
        voice = self._resolve_voice(request)
        state = Request(
            request_id=request.request_id,
            priority=request.priority,
            schedule=request.schedule,
            arrival_time=self.scheduler.clock(),
            ttfa_target_s=self.econfig.scheduler.ttfa_target_s,
            sampling=self._sampling(request),
            max_wait_s=request.max_wait_s,
        )
        stream = Qwen3Stream(self, request, voice, ChunkChannel())
        self._streams[request.request_id] = stream
        try:
            self.core.add_request(state)
        except Exception:
            del self._streams[request.request_id]
            raise
        stream.ticket = state.ticket
        return stream

    def _push(self, stream: Qwen3Stream, segment: TextSegment, forced_frames: int | None = None) -> None:
        req, voice = stream._request, stream._voice
        if voice.clip is not None:  # tokenised once the clip's prompt is known (step thread)
            payload = SegmentPrompt(
                tokens=None, non_streaming=self.econfig.non_streaming_text, forced_frames=forced_frames
            )
            self._pending_prompts[id(payload)] = (segment, req, voice)
        else:
            payload = self._segment_prompt(segment, req, voice, forced_frames)
        max_frames = forced_frames if forced_frames is not None else self._max_frames(req)
        seg = Segment(text=segment, prompt_len=0, max_frames=max_frames, payload=payload)
        self.core.add_segment(stream.request_id, seg)

    def _segment_prompt(
        self, segment: TextSegment, req: SynthesisRequest, voice: _Voice, forced_frames: int | None
    ) -> SegmentPrompt:
        prompt_req = PromptRequest(
            text=segment.text,
            language=segment.language or req.language,
            speaker=voice.speaker,
            instruct=req.instructions,
            speaker_embedding=voice.speaker_embedding,
            ref_codes=voice.ref_codes,
            ref_text=voice.ref_text,
            non_streaming=self.econfig.non_streaming_text,
        )
        try:
            tokens = tokenize_request(self.tokenizer, self.cfg, prompt_req)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return SegmentPrompt(
            tokens=tokens,
            speaker_embedding=voice.speaker_embedding,
            ref_codes=voice.ref_codes,
            non_streaming=self.econfig.non_streaming_text,
            forced_frames=forced_frames,
        )

    def _prepare(self, segments: list[Segment]) -> list[str | None]:
        """Ready segments' prompts (a step's start), their embeddings in one batch; a
        failed batch is retried segment by segment, so a bad one fails only its own request."""
        errors: list[str | None] = [None] * len(segments)
        for i, segment in enumerate(segments):
            errors[i] = _error_of(self._resolve_clip, segment)
        ready = [i for i, e in enumerate(errors) if e is None]
        if _error_of(self.runner.prepare, [segments[i].payload for i in ready]) is not None:
            for i in ready:
                errors[i] = _error_of(self.runner.prepare, [segments[i].payload])
        for i, segment in enumerate(segments):
            if errors[i] is None:
                errors[i] = _error_of(self._finish_prompt, segment)
        return errors

    def _resolve_clip(self, segment: Segment) -> None:
        pending = self._pending_prompts.pop(id(segment.payload), None)
        if pending is not None:  # a one-off clip: its prompt comes from the cache (computed once per clip)
            text, req, voice = pending
            assert self.voice_cache is not None and voice.clip is not None
            prompt = self.voice_cache.prompt_for(voice.clip, SAMPLE_RATE, voice.ref_text)
            cloned = _Voice(
                speaker_embedding=prompt.speaker_embedding,
                ref_codes=prompt.ref_codes,
                ref_text=prompt.ref_text,
            )
            segment.payload = self._segment_prompt(text, req, cloned, segment.payload.forced_frames)

    def _finish_prompt(self, segment: Segment) -> None:
        try:
            segment.prompt_len = self.runner.prompt_length(segment.payload)
        except ValueError as exc:  # text past a slot's text positions: the request's own fault
            raise InvalidRequest(str(exc)) from exc
        max_len = self.econfig.runner.max_len
        if segment.prompt_len >= max_len:
            raise InvalidRequest(f"prompt of {segment.prompt_len} positions exceeds max_len {max_len}")
        if self.prefix_cache is not None:
            self._mark_prefix(segment)

    def _mark_prefix(self, segment: Segment) -> None:
        """Name the segment's text-independent prompt prefix, so its KV can come from the cache."""
        prompt: SegmentPrompt = segment.payload
        tokens = prompt.tokens
        assert tokens is not None
        ref_frames = None if prompt.ref_codes is None else int(prompt.ref_codes.shape[0])
        has_speaker = prompt.speaker_embedding is not None or tokens.speaker_id is not None
        n = prefix_length(
            tokens,
            has_speaker=has_speaker,
            ref_frames=ref_frames,
            non_streaming=prompt.non_streaming,
            prompt_len=segment.prompt_len,
        )
        if n <= 0:
            return
        segment.prefix_len = n
        segment.prefix_key = prefix_key(
            self.model_name,
            tokens,
            speaker_embedding=prompt.speaker_embedding,
            ref_codes=prompt.ref_codes,
            non_streaming=prompt.non_streaming,
            length=n,
        )

    async def register_voice(
        self, voice_id: str, audio: npt.NDArray[np.float32], sample_rate: int, text: str | None
    ) -> None:
        if self.voice_cache is None:
            raise InvalidRequest("voice cloning needs a Base model (this checkpoint has no speaker encoder)")
        cache = self.voice_cache
        prompt = await asyncio.to_thread(cache.register, voice_id, audio, sample_rate, text)
        self._voices[voice_id] = _Voice(
            speaker_embedding=prompt.speaker_embedding, ref_codes=prompt.ref_codes, ref_text=prompt.ref_text
        )

    async def unregister_voice(self, voice_id: str) -> None:
        self._voices.pop(voice_id, None)
        if self.voice_cache is not None:
            self.voice_cache.unregister(voice_id)

    # -- outputs (step thread) -----------------------------------------------------------------
    def _on_outputs(self, outs: list[RequestOutput]) -> None:
        batch = ChunkBatch()  # the step's chunks reach the event loop together
        try:
            for o in outs:
                stream = self._streams.get(o.request_id)
                if stream is not None:
                    self._emit(stream, o, batch)
        finally:
            batch.post()

    def _emit(self, stream: Qwen3Stream, o: RequestOutput, batch: ChunkBatch) -> None:
        for seg in o.finished_segments:
            stream.pending_words += estimate_words(seg)
        if o.audio is not None:
            words, stream.pending_words = tuple(stream.pending_words), []
            batch.put(
                stream.channel,
                AudioChunk(o.request_id, o.audio, o.sample_offset, words),
            )
            stream.samples_sent = o.sample_offset + len(o.audio)
        if not o.finished:
            return
        del self._streams[o.request_id]
        if o.status == RequestStatus.FINISHED_STOPPED:
            batch.put(
                stream.channel,
                AudioChunk(
                    o.request_id,
                    np.zeros(0, np.int16),
                    stream.samples_sent,
                    tuple(stream.pending_words),
                    final=True,
                ),
            )
        elif o.status == RequestStatus.FINISHED_ERROR and o.retry_after_s is not None:
            batch.fail(stream.channel, Overloaded(o.error or "engine at capacity", o.retry_after_s))
        elif o.status == RequestStatus.FINISHED_ERROR:
            batch.fail(stream.channel, _failure(o.error))
        else:
            batch.finish(stream.channel)


# errors that are the request's own fault (engine.api): the client is told them as such, also when
# they come from the step thread, which ends a request with a "Type: message" string (`_error_of`)
_CLIENT_ERRORS: dict[str, type[EngineError]] = {
    cls.__name__: cls for cls in (InvalidRequest, InvalidAudio, UnknownVoice)
}


def _failure(error: str | None) -> EngineError:
    """The exception a request that ended with `error` fails its stream with."""
    name, _, message = (error or "").partition(": ")
    typed = _CLIENT_ERRORS.get(name)
    return typed(message) if typed is not None else EngineError(error or "synthesis failed")


def _error_of(fn: Callable[..., object], *args: Any) -> str | None:
    """What failing `fn(*args)` ends its request with, or None."""
    try:
        fn(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
