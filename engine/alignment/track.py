"""One utterance's alignment bookkeeping, without threads or I/O: engine chunks and text segments in,
alignment jobs and output chunks out.

The wrapped engine's own words (native or estimated) are used only as a progress signal: they say
where each text segment's audio ends. Once a segment is complete and its audio is in, the audio
since the previous cut and the segment's text (what no probe has timed of it) become one `AlignJob`;
the aligner's words replace the engine's. Jobs are cut at segment boundaries on the utterance
timeline (and, in sync mode, after the words a probe timed), so windows never overlap and a word,
once sent, is never revised.

Modes: "sync" holds audio until the words inside it are known (each release carries its words);
"async" passes audio through at once and sends the words as words-only chunks when ready;
"off" passes the engine's chunks through untouched.

Probes (sync mode): an engine may say where a segment ends only once it has spoken all of it (the
Qwen3 engine does), so sync audio would wait for whole segments. While a segment is still being
made, its audio so far is aligned against its text not yet timed (a probe). A forced aligner must
place every unit somewhere, so a probe's word counts only when it ends well before the probe's
audio does and the previous probe gave it the same times (more audio did not move it). The words
that pass, from the first on, are sent with the audio up to the last one's end; that point becomes
the next window's start, so nothing sent is revised and windows still never overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from engine.alignment.api import AlignedWord
from engine.api import AudioChunk, TextSegment, WordTiming, float_samples

AlignmentMode = Literal["sync", "async", "off"]
ALIGNMENT_MODES: tuple[AlignmentMode, ...] = ("sync", "async", "off")
MIN_WINDOW_S = 0.1  # shorter windows are padded with silence (the aligner needs >= 10 ms)
PROBE_MIN_S = 0.5  # a sync window is probed once it holds this much audio,
PROBE_STEP_S = 0.25  # then after each this much more (or half of what the last probe saw, if more)
PROBE_GUARD_S = 0.24  # a probed word must end this long (three 80 ms slots) before the probe's audio
PROBE_AGREE_S = 0.04  # and keep the slots the probe before gave it (within half a slot)


def tail(segment: TextSegment, start: int) -> TextSegment:
    """The segment's text from `start` on, still pointing into the client's text."""
    if start == 0:
        return segment
    text = segment.text[start:]
    if segment.char_map is None:
        return TextSegment(text, segment.char_start + start, segment.language)
    return TextSegment(text, segment.source_offset(start), segment.language, segment.char_map[start:])


def content_end(segment: TextSegment) -> int | None:
    """Client offset just past the segment's last letter or digit; None when it has none."""
    for i in range(len(segment.text) - 1, -1, -1):
        if segment.text[i].isalnum():
            return segment.source_offset(i) + 1
    return None


@dataclass(slots=True)
class _Segment:
    segment: TextSegment
    char_lo: int
    char_hi: int
    content_end: int | None
    inner_words: list[WordTiming] = field(default_factory=list)
    done: bool = False  # the engine has spoken all of it
    timed: int = 0  # characters of its text already timed by probes

    @property
    def rest(self) -> TextSegment:
        """The part of the text no probe has timed."""
        return tail(self.segment, self.timed)

    @property
    def rest_has_content(self) -> bool:
        return self.content_end is not None and any(c.isalnum() for c in self.segment.text[self.timed :])

    def local_index(self, client_offset: int) -> int:
        """The first index of the text at or past `client_offset` in the client's text."""
        i = self.timed
        while i < len(self.segment.text) and self.segment.source_offset(i) < client_offset:
            i += 1
        return i

    @property
    def inner_start(self) -> int:
        return min(w.start_sample for w in self.inner_words)

    @property
    def inner_end(self) -> int:
        return max(w.end_sample for w in self.inner_words)


@dataclass(frozen=True, slots=True)
class JobPiece:
    """A segment's text at `offset` in the job's text."""

    segment: TextSegment
    offset: int


@dataclass(slots=True)
class AlignJob:
    request_id: str
    seq: int  # order within the utterance
    audio: npt.NDArray[np.float32]  # the window's samples (engine rate), padded to MIN_WINDOW_S
    sample_rate: int
    text: str
    language: str
    pieces: tuple[JobPiece, ...]
    window_start: int  # utterance sample of audio[0]
    window_end: int  # utterance sample where the window's real audio ends
    fallback: tuple[WordTiming, ...]  # the engine's words, used when alignment fails
    urgent: bool = False  # sync mode: audio waits on it
    cancelled: bool = False
    probe: bool = False  # a sync probe: the audio so far of a segment still being made
    # seconds of the window no earlier job of the utterance held (probes overlap): the stream's
    # own audio, beside the audio aligned in all (`aligner_stream_audio_s`, `aligner_audio_s`)
    fresh_s: float = 0.0

    @property
    def audio_s(self) -> float:
        return (self.window_end - self.window_start) / self.sample_rate

    def words_from(self, aligned: Sequence[AlignedWord]) -> tuple[WordTiming, ...]:
        """The aligner's words (seconds into the window, offsets into the job's text) on the utterance's
        timeline, with offsets into the client's text."""
        words: list[WordTiming] = []
        for word in aligned:
            text, start_s, end_s, c0, c1 = word.text, word.start_s, word.end_s, word.char_start, word.char_end
            piece = self._piece_at(c0)
            if piece is None or c1 <= c0:
                continue
            local0 = c0 - piece.offset
            local1 = min(c1 - piece.offset, len(piece.segment.text))
            start = self._clip(start_s)
            end = max(start, self._clip(end_s))
            words.append(
                WordTiming(
                    text=text,
                    start_sample=start,
                    end_sample=end,
                    char_start=piece.segment.source_offset(local0),
                    char_end=piece.segment.source_offset(local1 - 1) + 1,
                    source="aligner",
                )
            )
        return tuple(words)

    def _piece_at(self, c: int) -> JobPiece | None:
        for piece in reversed(self.pieces):
            if piece.offset <= c < piece.offset + len(piece.segment.text):
                return piece
        return None

    def _clip(self, seconds: float) -> int:
        sample = self.window_start + round(seconds * self.sample_rate)
        return min(max(sample, self.window_start), self.window_end)


class _Audio:
    """The utterance's audio from some sample on, as the engine's arrays: int16 PCM (what the
    engine workers hand, and what passes on unconverted) or float32."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, npt.NDArray[np.float32] | npt.NDArray[np.int16]]] = []
        self.end = 0  # one past the last sample received

    def append(self, samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]) -> None:
        if len(samples):
            self._parts.append((self.end, samples))
            self.end += len(samples)

    def _pieces(self, a: int, b: int) -> list[npt.NDArray[np.float32] | npt.NDArray[np.int16]]:
        return [s[max(0, a - at) : max(0, b - at)] for at, s in self._parts if at < b and at + len(s) > a]

    def slice(self, a: int, b: int) -> npt.NDArray[np.float32]:
        """Samples a..b as float32 (the aligner's input)."""
        pieces = [float_samples(p) for p in self._pieces(a, b)]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)

    def pcm(self, a: int, b: int) -> npt.NDArray[np.float32] | npt.NDArray[np.int16]:
        """Samples a..b to pass on: as they came when they came in one form (one chunk's own
        array when they lie in one), float32 otherwise."""
        pieces = self._pieces(a, b)
        if len(pieces) == 1:
            return pieces[0]
        if pieces and all(p.dtype == pieces[0].dtype for p in pieces):
            return np.concatenate(pieces)
        return self.slice(a, b)

    def drop_before(self, sample: int) -> None:
        while self._parts and self._parts[0][0] + len(self._parts[0][1]) <= sample:
            self._parts.pop(0)


class AlignmentTracker:
    def __init__(
        self,
        request_id: str,
        language: str,
        sample_rate: int,
        max_window_s: float,
        mode: AlignmentMode = "async",
    ) -> None:
        self.request_id = request_id
        self.language = language
        self.rate = sample_rate
        self.max_window = int(max_window_s * sample_rate)
        self.mode: AlignmentMode = mode
        self.started = False  # a chunk has come: the mode is fixed
        self._segments: list[_Segment] = []
        self._next = 0  # first segment not yet in a job
        self._window_start = 0  # utterance sample where the next job's window begins
        self._audio = _Audio()
        self._released = 0  # samples passed to the output
        self.inner_final = False
        self._jobs: dict[int, AlignJob] = {}  # submitted and not yet out, by seq
        self._submitted = 0  # jobs submitted (the next one's seq)
        self._results: dict[int, tuple[WordTiming, ...]] = {}
        self._emitted_jobs = 0  # jobs whose words are out, in order
        self.finished = False
        self._probe: AlignJob | None = None  # the probe in flight
        self._probed_to = 0  # where the last probe of segment `_next` ended (0: none yet)
        self._probe_times: dict[int, tuple[int, int]] = {}  # that probe's words: char_start -> times

    # -- inputs -----------------------------------------------------------------------------
    def set_mode(self, mode: AlignmentMode) -> None:
        if mode not in ALIGNMENT_MODES:
            raise ValueError(f"alignment mode must be one of {ALIGNMENT_MODES}")
        if not self.started:
            self.mode = mode

    def push(self, segment: TextSegment) -> None:
        lo, hi = segment.source_offset(0), segment.source_offset(len(segment.text))
        self._segments.append(_Segment(segment, lo, hi, content_end(segment)))

    def on_chunk(self, chunk: AudioChunk) -> tuple[list[AudioChunk], list[AlignJob]]:
        """An engine chunk: the chunks to pass on now and the jobs to submit."""
        self.started = True
        self.inner_final = self.inner_final or chunk.final
        if self.mode == "off":
            return [chunk], []
        samples = chunk.samples
        if samples.ndim != 1 or samples.dtype not in (np.int16, np.float32):
            samples = float_samples(samples)
        gap = chunk.sample_offset - self._audio.end
        if gap > 0:
            samples = np.concatenate((np.zeros(gap, samples.dtype), samples))
        elif gap < 0:
            samples = samples[min(-gap, len(samples)) :]
        self._audio.append(samples)
        for word in chunk.words:
            self._note_word(word)
        if chunk.final:
            for seg in self._segments:
                seg.done = True
        jobs = self._advance()
        probe = self._maybe_probe()
        if probe is not None:
            jobs.append(probe)
        out: list[AudioChunk] = []
        if self.mode == "async" and self._audio.end > self._released:
            out.append(self._release(self._audio.end, ()))
        return out + self._finish_if_done(), jobs

    def on_aligned(self, job: AlignJob, words: tuple[WordTiming, ...]) -> list[AudioChunk]:
        """A job's words (aligned, or the fallback): the chunks that can go out now, in order."""
        if job.probe:
            return self._on_probe(job, words)
        self._results[job.seq] = words
        out: list[AudioChunk] = []
        while self._emitted_jobs in self._results:
            done = self._jobs.pop(self._emitted_jobs)
            ready = self._results.pop(self._emitted_jobs)
            self._emitted_jobs += 1
            if self.mode == "sync":
                out.append(self._release(done.window_end, ready))
            elif ready:
                out.append(AudioChunk(self.request_id, np.zeros(0, np.float32), self._released, ready))
        self._audio.drop_before(min(self._released, self._window_start))
        return [c for c in out if len(c.samples) or c.words] + self._finish_if_done()

    @property
    def pending_jobs(self) -> int:
        return len(self._jobs)

    # -- internals ----------------------------------------------------------------------------
    def _note_word(self, word: WordTiming) -> None:
        index = self._segment_of(word.char_start)
        if index is None:
            return
        seg = self._segments[index]
        seg.inner_words.append(word)
        for earlier in self._segments[:index]:
            earlier.done = True  # the engine speaks segments in order
        if seg.content_end is not None and word.char_end >= seg.content_end:
            seg.done = True

    def _segment_of(self, char: int) -> int | None:
        found = None
        for i, seg in enumerate(self._segments):
            if seg.char_lo <= char:
                found = i
            if seg.char_lo <= char < seg.char_hi:
                return i
        return found

    def _advance(self) -> list[AlignJob]:
        jobs: list[AlignJob] = []
        segs = self._segments
        while self._next < len(segs):
            first = segs[self._next]
            if first.content_end is None:  # punctuation or space only: nothing to time
                self._step_segment(1)
                continue
            if not first.done:
                break
            if not first.rest_has_content:  # probes timed all of it: its audio goes with the next
                self._step_segment(1)
                continue
            last_content = max(i for i, s in enumerate(segs) if s.content_end is not None)
            if first.inner_words:
                group = [first]
                cut = max(self._window_start, first.inner_end)
                if self.inner_final and self._next == last_content:
                    cut = self._audio.end
            else:  # no timing from the engine: run up to the next segment it did time
                j = self._next
                while j < len(segs) and segs[j].done and not segs[j].inner_words:
                    j += 1
                group = segs[self._next : j]
                if j < len(segs) and segs[j].inner_words:
                    cut = max(self._window_start, segs[j].inner_start)
                elif self.inner_final:
                    cut = self._audio.end
                else:
                    break
            if self.inner_final:
                cut = min(cut, self._audio.end)
            if self._audio.end < cut:
                break
            jobs.append(self._job(group, cut))
            self._step_segment(len(group))
            self._window_start = cut
        return jobs

    def _step_segment(self, count: int) -> None:
        """Segment `_next` is dealt with: a probe of it is no longer wanted."""
        self._next += count
        if self._probe is not None:
            self._probe.cancelled = True
            self._probe = None
        self._probed_to = 0
        self._probe_times = {}

    def _job(self, group: list[_Segment], cut: int) -> AlignJob:
        text, pieces = "", []
        for seg in group:
            t = seg.rest.text
            if text and not text[-1].isspace() and t and not t[0].isspace():
                text += " "
            pieces.append(JobPiece(seg.rest, len(text)))
            text += t
        audio = self._audio.slice(self._window_start, cut)
        shortest = int(MIN_WINDOW_S * self.rate)
        if len(audio) < shortest:
            audio = np.concatenate((audio, np.zeros(shortest - len(audio), np.float32)))
        language = next((s.segment.language for s in group if s.segment.language), None) or self.language
        untimed = group[0].rest.source_offset(0)
        fallback = tuple(w for s in group for w in s.inner_words if w.char_start >= untimed)
        job = AlignJob(
            request_id=self.request_id,
            seq=self._submitted,
            audio=audio,
            sample_rate=self.rate,
            text=text,
            language=language,
            pieces=tuple(pieces),
            window_start=self._window_start,
            window_end=cut,
            fallback=fallback,
            urgent=self.mode == "sync",
        )
        self._jobs[job.seq] = job
        self._submitted += 1
        return job

    def _maybe_probe(self) -> AlignJob | None:
        """Sync mode, nothing else outstanding: a probe of the segment being made, when its window
        has grown enough since the last one."""
        if self.mode != "sync" or self._probe is not None or self.pending_jobs or self.inner_final:
            return None
        if self._next >= len(self._segments):
            return None
        seg = self._segments[self._next]
        if seg.done or not seg.rest_has_content:
            return None
        start, end = self._window_start, self._audio.end
        if end - start < PROBE_MIN_S * self.rate or end - start > self.max_window:
            return None
        if self._probed_to:
            step = max(int(PROBE_STEP_S * self.rate), (self._probed_to - start) // 2)
            if end - self._probed_to < step:
                return None
        self._probed_to = end
        rest = seg.rest
        self._probe = AlignJob(
            request_id=self.request_id,
            seq=-1,
            audio=self._audio.slice(start, end),
            sample_rate=self.rate,
            text=rest.text,
            language=rest.language or self.language,
            pieces=(JobPiece(rest, 0),),
            window_start=start,
            window_end=end,
            fallback=(),
            urgent=True,
            probe=True,
        )
        return self._probe

    def _on_probe(self, probe: AlignJob, words: tuple[WordTiming, ...]) -> list[AudioChunk]:
        if probe is not self._probe:
            return []  # its segment was cut meanwhile: the job that cut it times these words
        self._probe = None
        earlier = self._probe_times
        self._probe_times = {w.char_start: (w.start_sample, w.end_sample) for w in words}
        latest_end = probe.window_end - int(PROBE_GUARD_S * self.rate)
        agree = int(PROBE_AGREE_S * self.rate)
        final: list[WordTiming] = []
        for word in words:
            before = earlier.get(word.char_start)
            if (
                word.end_sample > latest_end
                or before is None
                or abs(before[0] - word.start_sample) > agree
                or abs(before[1] - word.end_sample) > agree
            ):
                break
            final.append(word)
        if not final:
            return []
        seg = self._segments[self._next]
        seg.timed = seg.local_index(final[-1].char_end)
        self._window_start = max(self._window_start, final[-1].end_sample)
        out = [self._release(self._window_start, tuple(final))]
        self._audio.drop_before(min(self._released, self._window_start))
        return out

    def window_too_long(self, job: AlignJob) -> bool:
        return job.window_end - job.window_start > self.max_window

    def _release(self, upto: int, words: tuple[WordTiming, ...]) -> AudioChunk:
        samples = self._audio.pcm(self._released, upto) if upto > self._released else np.zeros(0, np.float32)
        chunk = AudioChunk(self.request_id, samples, self._released, words)
        self._released = max(self._released, upto)
        return chunk

    def _finish_if_done(self) -> list[AudioChunk]:
        if self.finished or not self.inner_final or self.pending_jobs or self._next < len(self._segments):
            return []
        self.finished = True
        out: list[AudioChunk] = []
        if self._audio.end > self._released:
            out.append(self._release(self._audio.end, ()))
        out.append(AudioChunk(self.request_id, np.zeros(0, np.float32), self._released, final=True))
        return out
