"""Incremental text segmentation: the client's text, token by token in, engine segments out.

A segment ends after sentence punctuation (. ! ? … and full-width 。！？), a line break, or, once
it is at least `clause_min_chars` long, clause punctuation (, ; : and ，、；：). ASCII punctuation
counts only when whitespace follows it, so 3.14, 1,000, example.com/a?b and https:// never split,
and a full stop after a known abbreviation (Dr., e.g.) or a single initial (J.) does not either.
Segments keep their trailing whitespace, so their texts concatenate back to the client's text, and
each carries `char_start`, its offset in that text. No segment is longer than `max_chars`.
"""

from __future__ import annotations

from typing import Final

from engine.api import TextSegment

SENTENCE_ASCII: Final = frozenset(".!?…")
SENTENCE_WIDE: Final = frozenset("。！？｡")
CLAUSE_ASCII: Final = frozenset(",;:")
CLAUSE_WIDE: Final = frozenset("，、；：")
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
        self._start = start_offset  # offset of _buffer[0] in the client's text

    @property
    def pending(self) -> str:
        """Text received but not yet cut into a segment."""
        return self._buffer

    def feed(self, text: str) -> list[TextSegment]:
        """Add text; return the segments it completes."""
        self._buffer += text
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
            if piece.strip():
                out.append(TextSegment(piece, char_start=self._start))
            self._start += end
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
        return min(j, max(i, self.max_chars))

    def _forced_cut(self) -> int:
        """No boundary within max_chars: cut at the last clause mark or space, else at max_chars."""
        window = self._buffer[: self.max_chars]
        for marks in (CLAUSE_ASCII | CLAUSE_WIDE, frozenset(" \t\n")):
            best = max((window.rfind(m) for m in marks), default=-1)
            if best > 0:
                return best + 1
        return self.max_chars
