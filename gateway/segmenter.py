"""Incremental text segmentation: the client's text, token by token in, engine segments out.

A segment ends after sentence punctuation (. ! ? … ‼ and full-width 。！？．｡), a line break, or,
once it is at least `clause_min_chars` long, clause punctuation (, ; : and ，、；：､ and their small
forms): the marks of all ten Qwen3-TTS languages (Spanish ¿ ¡ open a sentence and never end one,
French spaced "Oui !" is cut after the mark, Russian uses the ASCII marks). ASCII punctuation
counts only when whitespace follows it, so 3.14, 1,000, example.com/a?b and https:// never split,
and a full stop after a known abbreviation (Dr., e.g.) or a single initial (J.) does not either.
Segments keep their trailing whitespace, so their texts concatenate back to the client's text, and
each carries `char_start`, its offset in that text. No segment is longer than `max_chars`.

`UtteranceText` puts the language tags (gateway.languages) in front: tags are removed, a language
change ends the segment, each segment carries its language (the tag's, or the Auto rule's), and a
`char_map` when removed tags make its characters' offsets in the client's text non-contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from engine.api import TextSegment
from gateway.languages import LanguageTagger, Run, detect_language, normalise_language

SENTENCE_ASCII: Final = frozenset(".!?…‼⁇⁈⁉")
SENTENCE_WIDE: Final = frozenset("。！？｡．")
CLAUSE_ASCII: Final = frozenset(",;:")
CLAUSE_WIDE: Final = frozenset("，、；：､﹐﹑﹔﹕")
CLOSERS: Final = frozenset("\"')]}”’»」』）】〕")
ABBREVIATIONS: Final = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc cf approx dept fig no e.g i.e a.m p.m u.s".split()
)


def _is_abbreviation(text: str, dot: int) -> bool:
    """Whether the full stop at text[dot] closes an abbreviation or an initial."""
    start = dot
    while start > 0 and not text[start - 1].isspace() and text[start - 1] not in CLOSERS:
        start -= 1
    word = text[start:dot].lower().lstrip("(\"'“‘«")
    if not word:
        return False
    if len(word) == 1 and word.isalpha():
        return True  # an initial: "J. R. R. Tolkien"
    return word in ABBREVIATIONS


class Segmenter:
    def __init__(self, max_chars: int = 300, clause_min_chars: int = 40, start_offset: int = 0) -> None:
        if max_chars <= 0:
            raise ValueError("max_chars must be positive")
        self.max_chars = max_chars
        self.clause_min_chars = clause_min_chars
        self._buffer = ""
        self._offsets: list[int] = []  # _offsets[i]: offset of _buffer[i] in the client's text
        self._next = start_offset  # offset of the next character fed without explicit offsets

    @property
    def pending(self) -> str:
        """Text received but not yet cut into a segment."""
        return self._buffer

    def feed(self, text: str, offsets: Sequence[int] | None = None) -> list[TextSegment]:
        """Add text (`offsets`: each character's offset in the client's text, when not simply the
        next ones); return the segments it completes."""
        if offsets is None:
            offsets = range(self._next, self._next + len(text))
        elif len(offsets) != len(text):
            raise ValueError("one offset per character")
        self._buffer += text
        self._offsets.extend(offsets)
        if text:
            self._next = self._offsets[-1] + 1
        return self._cut(final=False)

    def flush(self) -> list[TextSegment]:
        """Cut everything pending (on speak.flush, speak.end)."""
        return self._cut(final=True)

    # -- internals ------------------------------------------------------------------------
    def _cut(self, final: bool) -> list[TextSegment]:
        out: list[TextSegment] = []
        while self._buffer:
            end = self._next_boundary(final)
            if end is None:
                if len(self._buffer) > self.max_chars:
                    end = self._forced_cut()
                elif final:
                    end = len(self._buffer)
                else:
                    break
            piece, self._buffer = self._buffer[:end], self._buffer[end:]
            offsets, self._offsets = self._offsets[:end], self._offsets[end:]
            if piece.strip():
                contiguous = offsets[-1] - offsets[0] == len(offsets) - 1
                out.append(
                    TextSegment(piece, char_start=offsets[0], char_map=None if contiguous else tuple(offsets))
                )
        return out

    def _next_boundary(self, final: bool) -> int | None:
        """End (exclusive) of the first complete segment in the buffer, or None."""
        text = self._buffer
        limit = min(len(text), self.max_chars)
        i = 0
        while i < limit:
            c = text[i]
            if c in SENTENCE_WIDE or c in CLAUSE_WIDE:
                end = self._after_closers(i + 1)
                if end == len(text) and not final:
                    return None  # a closing quote may follow
                if c in SENTENCE_WIDE or end >= self.clause_min_chars:
                    return self._after_space(end)
            elif c == "\n" and text[:i].strip():
                return self._after_space(i)
            elif c in SENTENCE_ASCII or c in CLAUSE_ASCII:
                run = i + 1
                while run < len(text) and text[run] in SENTENCE_ASCII:
                    run += 1
                end = self._after_closers(run)
                if end == len(text) and not final:
                    return None  # what follows decides (3.14 vs "3. Then"); wait for more text
                if end < len(text) and not text[end].isspace():
                    i = end
                    continue
                sentence = c in SENTENCE_ASCII
                if sentence and c == "." and run == i + 1 and _is_abbreviation(text, i):
                    i = end
                    continue
                if sentence or end >= self.clause_min_chars:
                    return self._after_space(end)
                i = end
                continue
            i += 1
        return None

    def _after_closers(self, i: int) -> int:
        while i < len(self._buffer) and self._buffer[i] in CLOSERS:
            i += 1
        return i

    def _after_space(self, i: int) -> int:
        """Past the whitespace after a boundary, without growing the segment beyond max_chars."""
        j = i
        while j < len(self._buffer) and self._buffer[j].isspace():
            j += 1
        return min(j, self.max_chars)  # a long run of marks ("?!?!") may be cut inside

    def _forced_cut(self) -> int:
        """No boundary within max_chars: cut at the last clause mark or space, else at max_chars."""
        window = self._buffer[: self.max_chars]
        for marks in (CLAUSE_ASCII | CLAUSE_WIDE, frozenset(" \t\n")):
            best = max((window.rfind(m) for m in marks), default=-1)
            if best > 0:
                return best + 1
        return self.max_chars


class UtteranceText:
    """One utterance's client text -> engine segments: language tags removed, a segment never spans
    two languages, each labelled with its language (a tag's; under "Auto" the Auto rule's, else
    None = the request's), then cut by a Segmenter."""

    def __init__(
        self,
        language: str | None,
        max_chars: int = 300,
        clause_min_chars: int = 40,
        start_offset: int = 0,
        open_languages: Sequence[str] = (),
    ) -> None:
        self.auto = normalise_language(language) == "Auto"
        self._tagger = LanguageTagger(start_offset, open_languages)
        self._segmenter = Segmenter(max_chars, clause_min_chars, start_offset)
        self._tag_language = self._tagger.language  # the language of the text in the segmenter
        self._previous: str | None = None  # the last segment's language

    @property
    def pending(self) -> str:
        return self._segmenter.pending

    def feed(self, text: str) -> list[TextSegment]:
        return self._take(self._tagger.feed(text))

    def flush(self) -> list[TextSegment]:
        out = self._take(self._tagger.flush())
        return out + self._label(self._segmenter.flush())

    def _take(self, runs: list[Run]) -> list[TextSegment]:
        out: list[TextSegment] = []
        for run in runs:
            # text without letters or digits (spaces, punctuation between tags) joins the current span
            if run.language != self._tag_language and any(ch.isalnum() for ch in run.text):
                out += self._label(self._segmenter.flush())
                self._tag_language = run.language
            out += self._label(self._segmenter.feed(run.text, run.offsets))
        return out

    def _label(self, segments: list[TextSegment]) -> list[TextSegment]:
        out = []
        for segment in segments:
            language = self._tag_language
            if language is None and self.auto:
                language = detect_language(segment.text) or self._previous
            self._previous = language
            out.append(TextSegment(segment.text, segment.char_start, language, segment.char_map))
        return out
