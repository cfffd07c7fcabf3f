"""What crosses between the scheduler and the runner each step (plain Python, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

# one frame's 16 codes; the runner hands out tuples: a request keeps every frame it made, and the
# cyclic collector untracks tuples of ints where it walks every list, so a full collection over
# hundreds of streams' frames stays short
Frame = Sequence[int]


@dataclass(slots=True)
class PrefillChunk:
    request_id: str
    kv_slot: int  # talker cache row written by this chunk
    codec_slot: int  # the request's Code2Wav row (for sampling state keyed per stream)
    start: int  # first position of the chunk in the segment's talker sequence
    length: int  # positions in the chunk (start + length <= the segment's context target)
    # positions [prompt_len, prompt_len + frames) re-embed already generated frames (a resume after
    # preemption); the runner rebuilds them from `codes`
    prompt_len: int
    payload: Any  # the segment's prompt data, opaque to the scheduler
    samples_frame: bool  # the chunk completes the context: its last position samples a frame
    frame_index: int  # index within the segment of the frame sampled (valid if samples_frame)
    utterance_frame: int  # index of that frame on the request's timeline (seeds the row's noise)
    codes: list[Frame] = field(default_factory=list)  # segment frames to re-embed on a resume
    sampling: Any = None  # the request's sampling parameters
    copied: int = 0  # prompt positions the slot got from the prefix cache (its prefill starts there)
    prefix_key: str | None = (
        None  # the segment's text-independent prompt prefix (see engine.qwen3.prefix_cache)
    )
    prefix_len: int = 0


@dataclass(slots=True)
class PrefixCopy:
    kv_slot: int  # talker cache row whose first `length` positions come from the prefix cache
    key: str
    length: int


@dataclass(slots=True)
class DecodeRow:
    request_id: str
    kv_slot: int  # talker cache row
    codec_slot: int
    position: int  # position of the input (the previous frame) in the segment's talker sequence
    frame_index: int  # index within the segment of the frame this step samples (>= 1)
    utterance_frame: int  # index of that frame on the request's timeline (seeds the row's noise)
    payload: Any  # the segment's prompt data (trailing text track for streaming text input)
    sampling: Any = None


@dataclass(slots=True)
class CodecChunk:
    request_id: str
    codec_slot: int  # Code2Wav state row
    first_frame: int  # index on the request's frame timeline of codes[0]
    codes: list[Frame]  # the frames to decode now, [num_frames][16]
    first_chunk: bool  # the request's first chunk (scheduled first, counts for TTFA)

    @property
    def num_frames(self) -> int:
        return len(self.codes)


@dataclass(frozen=True, slots=True)
class FirstAudio:
    request_id: str
    codec_slot: int
    frame: int = 0  # the sampled frame's index on the request's timeline (0: its first audio)


@dataclass(slots=True)
class StepPlan:
    step: int  # step counter, increasing by one per schedule()
    decode: list[DecodeRow] = field(default_factory=list)  # one frame each, batched (CUDA graph)
    prefill: list[PrefillChunk] = field(default_factory=list)  # prompt chunks, batched and padded
    codec: list[CodecChunk] = field(default_factory=list)  # Code2Wav work, grouped by frame count
    codec_resets: list[int] = field(default_factory=list)  # codec rows given to new requests: zero them
    freed_kv_slots: list[int] = field(default_factory=list)  # talker rows released since the last plan
    num_prefill_tokens: int = 0  # sum of chunk lengths (the step's token budget minus decode rows)
    prefix_copies: list[PrefixCopy] = field(default_factory=list)  # run before the prefill
    # requests whose first frame this step samples and whose first chunk is that one frame: the
    # runner decodes it right after sampling, in this step, instead of in the next step's codec
    first_audio_now: list[FirstAudio] = field(default_factory=list)
    # Code2Wav audio is still on its way from an earlier step: run the step to collect it
    audio_in_flight: bool = False

    @property
    def sampling_rows(self) -> list[str]:
        """Request ids in the order of StepOutput.codes: decode rows, then completing chunks."""
        return [r.request_id for r in self.decode] + [c.request_id for c in self.prefill if c.samples_frame]

    @property
    def is_empty(self) -> bool:
        return not (
            self.decode
            or self.prefill
            or self.codec
            or self.codec_resets
            or self.prefix_copies
            or self.audio_in_flight
        )


@dataclass(slots=True)
class StepOutput:
    # sampled frames in plan.sampling_rows order: 16 codes each (one host transfer per step); the
    # scheduler keeps each row as the request's frame, so a runner hands over fresh rows (tuples)
    codes: list[Frame] = field(default_factory=list)
    # request id -> the samples of its codec chunk (num_frames * samples_per_frame): int16 PCM as the
    # runner makes them on the device (`engine.api.pcm16`'s rounding), or float32 in [-1, 1]
    audio: dict[str, npt.NDArray[np.int16] | npt.NDArray[np.float32]] = field(default_factory=dict)
    # (request id, frames) of the chunks in `audio`, when they are not simply this plan's chunks: a
    # runner that defers Code2Wav delivers a step's chunks with the next step's output
    delivered: list[tuple[str, int]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (scheduler -> engine front end)."""

    request_id: str
    audio: npt.NDArray[np.int16] | npt.NDArray[np.float32] | None = None  # a decoded chunk
    sample_offset: int = 0  # index of audio[0] on the utterance's timeline
    finished_segments: list[Any] = field(default_factory=list)  # request.Segment objects just completed
    finished: bool = False  # the request has ended (see status)
    status: Any = None  # request.RequestStatus after this step
    error: str | None = None
    retry_after_s: float | None = None  # the error is a refusal: overloaded, retry after this long
