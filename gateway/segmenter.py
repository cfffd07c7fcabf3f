"""Incremental text segmentation: the client's text, token by token in, engine segments out.

A segment ends after sentence punctuation (. ! ? … ‼ and full-width 。！？．｡), a line break, or,
once it is at least `clause_min_chars` long, clause punctuation (, ; : and ，、；：､ and their small
forms): the marks of all ten Qwen3-TTS languages (Spanish ¿ ¡ open a sentence and never end one,
French spaced "Oui !" is cut after the mark, Russian uses the ASCII marks). ASCII punctuation
counts only when whitespace follows it, so 3.14, 1,000, example.com/a?b and https:// never split,
and a full stop after a known abbreviation (Dr., e.g.; "no" only before a number), an initial (J.,
U.S.A.) or the number opening a list line ("1. ") does not either; nor does a full-width mark
between digits (３．５, 10：30). Segments keep their trailing whitespace, so their texts concatenate
back to the client's text, and each carries `char_start`, its offset in that text. No segment is
longer than `max_chars`: without a boundary the cut falls after a clause mark or a space, else
at the limit, moved back so that it never splits a grapheme.

`UtteranceText` puts the language tags (gateway.languages) in front: tags are removed, a language
change ends the segment, each segment carries its language (the tag's, or the Auto rule's), and a
`char_map` when removed tags make its characters' offsets in the client's text non-contiguous.
"""

from __future__ import annotations

import re
import unicodedata
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
    "mr mrs ms dr prof sr jr st mt vs etc cf approx dept fig e.g i.e a.m p.m u.s".split()
)
# abbreviations only in front of a number: "No. 5", but "The answer is no. You ..." ends a sentence
NUMBER_ABBREVIATIONS: Final = frozenset({"no"})
# an initial ("J. R. R. Tolkien") or dotted initials ("U.S.A.", "U.K.")
_INITIALS: Final = re.compile(r"[^\W\d_](?:\.[^\W\d_])*")


def _is_abbreviation(text: str, dot: int) -> bool:
    """Whether the full stop at text[dot] closes an abbreviation or an initial. The word runs back
    to the previous space: an apostrophe inside it belongs to it ("don't." is no initial "t.")."""
    start = dot
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    word = text[start:dot].lower().lstrip("(\"'“‘«")
    if not word:
        return False
    if word in NUMBER_ABBREVIATIONS:
        after = text[dot + 1 :].lstrip()
        return not after or after[0].isdecimal()  # nothing after it yet: undecided, so no cut yet
    return word in ABBREVIATIONS or _INITIALS.fullmatch(word) is not None


def _between_digits(text: str, i: int) -> bool:
    """Whether text[i] sits inside a number ("３．５", "10：30", "１，０００")."""
    return 0 < i < len(text) - 1 and text[i - 1].isdecimal() and text[i + 1].isdecimal()


def _is_regional_indicator(ch: str) -> bool:
    return 0x1F1E6 <= ord(ch) <= 0x1F1FF


def _continues_grapheme(text: str, i: int) -> bool:
    """Whether text[i] belongs to the grapheme of text[i - 1]: the cases of UAX #29 that LLM text
    carries (combining marks and variation selectors, ZWJ sequences, skin tones, emoji tag
    sequences, keycaps, flag pairs, CR LF)."""
    ch, prev = text[i], text[i - 1]
    code = ord(ch)
    if unicodedata.category(ch) in ("Mn", "Me", "Mc") or "\u200d" in (ch, prev):
        return True
    if 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F or (prev, ch) == ("\r", "\n"):
        return True
    if _is_regional_indicator(ch) and _is_regional_indicator(prev):
        run = 1  # regional indicators pair up from the start of their run
        while i - run - 1 >= 0 and _is_regional_indicator(text[i - run - 1]):
            run += 1
        return run % 2 == 1
    return False


class Segmenter:
    def __init__(self, max_chars: int = 300, clause_min_chars: int = 40, start_offset: int = 0) -> None:
        if max_chars <= 0:
            raise ValueError("max_chars must be positive")
        self.max_chars = max_chars
        self.clause_min_chars = clause_min_chars
        self._buffer = ""
        self._offsets: list[int] = []  # _offsets[i]: offset of _buffer[i] in the client's text
        self._next = start_offset  # offset of the next character fed without explicit offsets
        self._line_start = True  # whether _buffer[0] begins a line of the client's text

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
            self._line_start = piece.rstrip(" \t").endswith("\n")
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
                if _between_digits(text, i):
                    i += 1
                    continue
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
                if (
                    sentence
                    and c == "."
                    and run == i + 1
                    and (_is_abbreviation(text, i) or self._is_list_marker(text, i))
                ):
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

    def _is_list_marker(self, text: str, dot: int) -> bool:
        """Whether the full stop at text[dot] ends the number of a numbered list item: digits that
        open a line ("1. Open the app")."""
        start = dot
        while start > 0 and text[start - 1].isdecimal():
            start -= 1
        if not 0 < dot - start <= 3:
            return False
        before = text[:start].rstrip(" \t")
        return before.endswith("\n") if before else self._line_start

    def _forced_cut(self) -> int:
        """No boundary within max_chars: cut after the last clause mark that could end a clause (not
        one inside a number, time or URL), else after the last space, else at max_chars moved back
        to the start of a grapheme."""
        text = self._buffer
        for k in range(self.max_chars - 1, 0, -1):
            c = text[k]
            if (c in CLAUSE_ASCII and text[k + 1].isspace()) or (
                c in CLAUSE_WIDE and not _between_digits(text, k)
            ):
                return k + 1
        best = max(text.rfind(m, 0, self.max_chars) for m in " \t\n")
        if best > 0:
            return best + 1
        cut = self.max_chars
        while cut > 0 and _continues_grapheme(text, cut):
            cut -= 1
        return cut or self.max_chars  # one grapheme longer than max_chars: the limit wins


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

    def flush(self, final: bool = True) -> list[TextSegment]:
        """Cut everything pending. Before the end of the text (`final` False: speak.flush) a tail
        that may still become a tag ("<e") stays with the tagger for the next append."""
        out = self._take(self._tagger.flush() if final else [])
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
