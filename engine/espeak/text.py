"""Text helpers for the eSpeak engine: sentence cuts, script detection, and turning eSpeak's WORD
events into word spans with times (pure Python, no eSpeak needed).

eSpeak reports a WORD event with a 1-based code-point position into the string of one synth call
and the time (ms from the call's start). Its `length` is unreliable (CJK dictionary words such as
一起 come as one event of length 1; numbers give several events at one position; French "tout le
monde" gives one event), so words are the client's whitespace tokens, cut further at event
positions inside CJK runs, and a word without an event of its own is interpolated between its
timed neighbours by character count.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_SENTENCE_END = re.compile(r"[.!?;…]+[\"'”’)\]]*\s+|[。！？；]+[”’」』)）]*\s*")


_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs etc e.g i.e no fig approx dept inc ltd co corp mt ft".split()
)


def _is_abbreviation(text: str, dot: int) -> bool:
    """Is the "." at `dot` the end of an abbreviation or an initial ("Mr.", "e.g.", "J.")?"""
    if text[dot] != ".":
        return False
    word = text[:dot].rsplit(None, 1)[-1] if text[:dot].strip() else ""
    word = word.lstrip("\"'“‘([").lower()
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(text: str) -> list[tuple[int, int]]:
    """[start, end) spans covering `text`, cut after sentence-final punctuation."""
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _SENTENCE_END.finditer(text):
        if _is_abbreviation(text, match.start()):
            continue
        if match.end() > start:
            spans.append((start, match.end()))
            start = match.end()
    if start < len(text):
        spans.append((start, len(text)))
    return [span for span in spans if text[span[0] : span[1]].strip()]


def is_cjk(ch: str) -> bool:
    code = ord(ch)
    return (
        0x3400 <= code <= 0x4DBF
        or 0x4E00 <= code <= 0x9FFF
        or 0xF900 <= code <= 0xFAFF
        or 0x20000 <= code <= 0x2FA1F
        or 0x3040 <= code <= 0x30FF  # kana
        or 0xAC00 <= code <= 0xD7AF  # hangul
    )


def script_language(text: str) -> str:
    """The eSpeak language a text's script suggests (for language "Auto")."""
    han = kana = hangul = cyrillic = latin = 0
    for ch in text:
        code = ord(ch)
        if 0x3040 <= code <= 0x30FF:
            kana += 1
        elif 0xAC00 <= code <= 0xD7AF or 0x1100 <= code <= 0x11FF:
            hangul += 1
        elif is_cjk(ch):
            han += 1
        elif 0x0400 <= code <= 0x04FF:
            cyrillic += 1
        elif ch.isalpha():
            latin += 1
    counts = {"ja": kana, "ko": hangul, "cmn": han, "ru": cyrillic, "en-us": latin}
    if kana and kana + han >= max(hangul, cyrillic, latin):
        return "ja"
    best = max(counts, key=lambda k: counts[k])
    return best if counts[best] else "en-us"


def _is_punct(ch: str) -> bool:
    return unicodedata.category(ch).startswith("P")


def word_spans(text: str) -> list[tuple[int, int]]:
    """Whitespace tokens, cut at punctuation inside CJK runs, with punctuation stripped off."""
    spans: list[tuple[int, int]] = []
    for match in re.finditer(r"\S+", text):
        start = match.start()
        for i in range(match.start(), match.end()):
            if _is_punct(text[i]) and _cuts_here(text, i):
                _append_stripped(text, start, i, spans)
                start = i + 1
        _append_stripped(text, start, match.end(), spans)
    return spans


def _cuts_here(text: str, i: int) -> bool:
    # punctuation splits a token where it is a dash, full-width, or follows a CJK character
    return (
        text[i] in "—–"
        or unicodedata.east_asian_width(text[i]) in ("W", "F")
        or (i > 0 and is_cjk(text[i - 1]))
    )


def _append_stripped(text: str, start: int, end: int, out: list[tuple[int, int]]) -> None:
    while start < end and _is_punct(text[start]):
        start += 1
    while end > start and _is_punct(text[end - 1]):
        end -= 1
    if end > start:
        out.append((start, end))


@dataclass(slots=True)
class TimedSpan:
    start_char: int  # in the synth call's text
    end_char: int
    start_sample: int  # on the utterance timeline
    end_sample: int


class WordTracker:
    """Turns one synth call's WORD events, as they arrive, into finished words.

    A word is finished once the next timed word starts (or the call ends); audio before the start
    of the word still open may be sent, so words always go out before or with their audio.
    """

    def __init__(self, text: str, origin: int) -> None:
        self._text = text
        self._spans = word_spans(text)
        self._origin = origin
        self._anchor: int | None = None  # index of the last span with an event of its own
        self._anchor_sample = origin
        self._done = 0  # spans before this index are finished

    @property
    def open_from(self) -> int | None:
        """Utterance sample where the unfinished words begin (None: nothing timed is open)."""
        return self._anchor_sample if self._anchor is not None else None

    def on_event(self, position: int, sample: int) -> list[TimedSpan]:
        """A WORD event: `position` 0-based in the call's text, `sample` on the utterance timeline."""
        index = self._span_at(position)
        if index is None or (self._anchor is not None and index <= self._anchor):
            return []
        sample = max(sample, self._anchor_sample)
        if self._anchor is None:
            # words before the first event (rare) share the time from the call's start
            finished = self._interpolate(self._done, index, self._origin, sample)
        else:
            finished = self._interpolate(self._anchor, index, self._anchor_sample, sample)
        self._anchor, self._anchor_sample = index, sample
        self._done = index
        return finished

    def finish(self, end_sample: int) -> list[TimedSpan]:
        """The call ended at `end_sample`: finish every remaining word."""
        start = self._anchor if self._anchor is not None else self._done
        first_sample = self._anchor_sample if self._anchor is not None else self._origin
        finished = self._interpolate(start, len(self._spans), first_sample, max(end_sample, first_sample))
        self._done = len(self._spans)
        self._anchor = None
        return finished

    def _span_at(self, position: int) -> int | None:
        """Index of the span an event at `position` starts, cutting a CJK span if needed."""
        for i in range(self._done, len(self._spans)):
            start, end = self._spans[i]
            if position < end:
                if start < position and is_cjk(self._text[position]):
                    self._spans[i : i + 1] = [(start, position), (position, end)]
                    return i + 1
                return i
        return None

    def _interpolate(self, first: int, stop: int, t0: int, t1: int) -> list[TimedSpan]:
        spans = self._spans[first:stop]
        weights = [end - start for start, end in spans]
        total = sum(weights) or 1
        out: list[TimedSpan] = []
        acc = 0
        for (start, end), weight in zip(spans, weights, strict=True):
            a = t0 + (t1 - t0) * acc // total
            acc += weight
            b = t0 + (t1 - t0) * acc // total
            out.append(TimedSpan(start, end, a, b))
        return out
