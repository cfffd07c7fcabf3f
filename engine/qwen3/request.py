"""One request's state as the scheduler sees it: plain Python, no torch.

A request is an utterance: text arrives as segments; each segment is synthesised as its own talker
sequence (prompt prefill, then one codec frame per step until EOS), while the frames of all
segments run through one Code2Wav stream, so the audio continues seamlessly across segments.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.api import ChunkSchedule, Priority, TextSegment
from engine.qwen3.plan import Frame

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1_920


class RequestStatus(enum.IntEnum):
    WAITING = 0  # needs a talker slot for its current segment (new, next segment, or preempted)
    PREFILLING = 1  # holds a talker slot; prompt chunks still to run
    DECODING = 2  # holds a talker slot; one frame per step
    WAITING_FOR_TEXT = 3  # all queued text synthesised, more may come; holds no talker slot
    DRAINING = 4  # text closed and synthesised; frames left for Code2Wav
    FINISHED_STOPPED = 5  # all audio emitted
    FINISHED_CANCELLED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


@dataclass(slots=True)
class Segment:
    """One text segment = one talker sequence."""

    text: TextSegment
    prompt_len: int  # talker prompt positions
    max_frames: int  # the segment stops here even without EOS
    payload: Any = None  # runner-specific prompt data (token ids, reference codes, ...)
    first_frame: int = 0  # index of this segment's first frame on the utterance's frame timeline
    frames: int = 0  # frames generated for this segment
    prefilled: int = 0  # positions currently in the talker KV cache
    done: bool = False  # EOS sampled or max_frames reached
    prefix_key: str | None = None  # hash of the prompt's text-independent prefix (None: no reuse)
    prefix_len: int = 0  # positions of that prefix
    copied: int = 0  # positions the current slot got from the prefix cache
    cap: int = 0  # frames this segment may take (0 until first asked; see Scheduler._segment_cap)

    @property
    def context_target(self) -> int:
        """Positions the prefill must cover before the next frame is sampled: the prompt, plus the
        frames already generated when the segment resumes after a preemption (recompute)."""
        return self.prompt_len + self.frames


@dataclass(eq=False)
class Request:
    request_id: str
    priority: Priority = Priority.INTERACTIVE
    schedule: ChunkSchedule = field(default_factory=ChunkSchedule)
    arrival_time: float = 0.0
    ttfa_target_s: float = 0.025  # first audio is due this long after arrival
    sampling: Any = None  # runner-specific sampling parameters
    status: RequestStatus = RequestStatus.WAITING_FOR_TEXT
    kv_slot: int | None = None  # talker cache row while PREFILLING / DECODING
    codec_slot: int | None = None  # Code2Wav state row, held from first admission to the end
    segments: deque[Segment] = field(default_factory=deque)  # text not yet synthesised
    current: Segment | None = None  # the segment being synthesised
    done_segments: list[Segment] = field(default_factory=list)
    text_closed: bool = False
    codes: list[Frame] = field(default_factory=list)  # every generated frame: 16 codes each
    frames_decoded: int = 0  # frames whose audio came back from Code2Wav
    frames_launched: int = 0  # frames handed to Code2Wav (their audio may still be on its way)
    chunks_emitted: int = 0  # chunks handed to Code2Wav
    first_audio_time: float | None = None
    min_lead_s: float = float("inf")  # smallest lead of a later chunk (engine.qwen3.delivery_leads)
    preemptions: int = 0
    error: str | None = None
    next_chunk_index: int = -1  # the chunk whose size next_chunk_frames holds (scheduler's memo)
    next_chunk_frames: int = 0
    max_wait_s: float | None = None  # the longest it may wait for admission (engine.api.SynthesisRequest)
    ticket: Any = None  # its engine.admission.Ticket, while the scheduler knows it
    retry_after_s: float | None = None  # refused: the error is an overload, retry after this long

    # -- derived ---------------------------------------------------------------------------
    @property
    def frames_generated(self) -> int:
        return len(self.codes)

    @property
    def frames_pending(self) -> int:
        """Generated frames not yet handed to Code2Wav."""
        return len(self.codes) - self.frames_launched

    @property
    def frames_in_flight(self) -> int:
        """Frames handed to Code2Wav whose audio has not come back yet."""
        return self.frames_launched - self.frames_decoded

    @property
    def deadline(self) -> float:
        """Wall time by which more audio must reach the listener: the first-audio target before
        the first chunk, then the moment the listener's buffer runs dry (real-time playback)."""
        if self.first_audio_time is None:
            return self.arrival_time + self.ttfa_target_s
        return self.first_audio_time + self.frames_launched * SAMPLES_PER_FRAME / SAMPLE_RATE

    @property
    def ttfa(self) -> float | None:
        return None if self.first_audio_time is None else self.first_audio_time - self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def admitted(self) -> bool:
        """Past admission (engine.admission): it may take a Code2Wav row and a talker slot."""
        return self.ticket is None or self.ticket.admitted_at is not None

    def sort_key(self) -> tuple[int, float, float]:
        """Admission order: priority class, then the earliest deadline, then arrival."""
        return (int(self.priority), self.deadline, self.arrival_time)
