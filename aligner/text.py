"""Text units for forced alignment, and their character spans in the client's text.

The Qwen3 forced aligner times *units*: whitespace words for most languages, every CJK ideograph on
its own, morphemes for Japanese and L/R parts of each space-separated word for Korean. Characters
other than letters, digits and the apostrophe are dropped from the units. This module reproduces
that splitting and maps every unit back to ``[char_start, char_end)`` code-point offsets of the text
exactly as the client sent it, so dropped punctuation and the segmenters' normalisation never shift
an offset.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

Segmenter = Callable[[str], list[str]]

LANGUAGE_ALIASES = {
    "ja": "japanese",
    "jp": "japanese",
    "jpn": "japanese",
    "ja-jp": "japanese",
    "ko": "korean",
    "kor": "korean",
    "ko-kr": "korean",
}


@dataclass(frozen=True, slots=True)
class Unit:
    """One aligned unit: its cleaned text and the span of its kept characters in the source text."""

    text: str
    char_start: int
    char_end: int


def is_kept_char(ch: str) -> bool:
    """Letters, digits and the apostrophe survive cleaning; everything else is dropped."""
    return ch == "'" or unicodedata.category(ch)[0] in "LN"


def clean(token: str) -> str:
    return "".join(ch for ch in token if is_kept_char(ch))


def is_cjk_ideograph(ch: str) -> bool:
    code = ord(ch)
    return (
        0x4E00 <= code <= 0x9FFF
        or 0x3400 <= code <= 0x4DBF
        or 0x20000 <= code <= 0x2A6DF
        or 0x2A700 <= code <= 0x2B73F
        or 0x2B740 <= code <= 0x2B81F
        or 0x2B820 <= code <= 0x2CEAF
        or 0xF900 <= code <= 0xFAFF
    )


def canonical_language(language: str) -> str:
    name = language.strip().lower()
    return LANGUAGE_ALIASES.get(name, name)


# --------------------------------------------------------------------------- splitters


def split_spaced(text: str) -> list[str]:
    """Whitespace words, cleaned; inside a cleaned word every CJK ideograph is its own unit."""
    units: list[str] = []
    for segment in text.split():
        kept = clean(segment)
        run: list[str] = []
        for ch in kept:
            if is_cjk_ideograph(ch):
                if run:
                    units.append("".join(run))
                    run = []
                units.append(ch)
            else:
                run.append(ch)
        if run:
            units.append("".join(run))
    return units


def nagisa_segmenter() -> Segmenter:
    """Japanese morphemes from nagisa (imported on first use: it loads a model, ~3 s)."""
    try:
        import nagisa
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "Japanese alignment needs the 'nagisa' package (pip install nagisa==0.2.11)"
        ) from exc

    def segment(text: str) -> list[str]:
        return list(nagisa.tagging(text).words)

    return segment


def split_japanese(text: str, segmenter: Segmenter) -> list[str]:
    return [unit for unit in (clean(word) for word in segmenter(text)) if unit]


def load_korean_dictionary(path: str | Path) -> dict[str, float]:
    """Read a jieba-style dictionary (``word freq tag`` per line); every listed word scores 1."""
    scores: dict[str, float] = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            if fields:
                scores[fields[0]] = 1.0
    return scores


def split_korean_word(word: str, scores: Mapping[str, float]) -> tuple[str, str]:
    """Split one space-separated word into its best-scoring left part and the rest.

    Candidates are every left part of at least two characters; the highest score wins and among
    equal scores the longest left part does, so a word with no dictionary prefix stays whole.
    Words of up to two characters stay whole.
    """
    if len(word) <= 2:
        return word, ""
    best_end, best_score = 2, scores.get(word[:2], 0.0)
    for end in range(3, len(word) + 1):
        score = scores.get(word[:end], 0.0)
        if score >= best_score:
            best_end, best_score = end, score
    return word[:best_end], word[best_end:]


def split_korean(text: str, scores: Mapping[str, float] | None) -> list[str]:
    """L/R parts of each space-separated word (cleaned). Without a dictionary, whole words."""
    units: list[str] = []
    for word in text.split():
        parts = split_korean_word(word, scores or {})
        units.extend(unit for unit in (clean(part) for part in parts) if unit)
    return units


# --------------------------------------------------------------------------- offsets


@functools.lru_cache(maxsize=8192)  # one character at a time: a text's alphabet is small
def _fold(ch: str) -> str:
    """Compatibility-decomposed, combining marks and dropped characters removed.

    Segmenters may normalise (nagisa turns full-width Latin into ASCII and half-width kana into
    full-width); folding both sides makes the unit characters comparable with the source text.
    """
    return "".join(c for c in unicodedata.normalize("NFKD", ch) if is_kept_char(c))


def _is_mark(ch: str) -> bool:
    """Combining marks, and letters that fold to one (the half-width kana voicing marks)."""
    return unicodedata.category(ch)[0] == "M" or (is_kept_char(ch) and not _fold(ch))


def _folded_stream(text: str) -> tuple[str, list[int]]:
    chars: list[str] = []
    owners: list[int] = []
    for index, ch in enumerate(text):
        for folded in _fold(ch):
            chars.append(folded)
            owners.append(index)
    return "".join(chars), owners


def locate_units(text: str, units: Iterable[str]) -> list[Unit]:
    """Place each unit, in order, over the source characters it came from.

    The span runs from the first to the last source character of the unit, so dropped characters
    inside a unit ("foo-bar" -> "foobar") are covered and those around it are not.
    """
    stream, owners = _folded_stream(text)
    located: list[Unit] = []
    cursor = 0
    for unit in units:
        folded = "".join(_fold(ch) for ch in unit)
        if not folded:
            position = owners[cursor] if cursor < len(owners) else len(text)
            located.append(Unit(unit, position, position))
            continue
        found = cursor if stream.startswith(folded, cursor) else stream.find(folded, cursor)
        if found < 0:
            position = owners[cursor] if cursor < len(owners) else len(text)
            located.append(Unit(unit, position, position))
            continue
        last = found + len(folded) - 1
        end = owners[last] + 1
        while end < len(text) and _is_mark(text[end]):
            end += 1  # marks belong to the character they follow
        located.append(Unit(unit, owners[found], end))
        cursor = last + 1
    return located


def display_spans(text: str, units: list[Unit]) -> list[tuple[int, int]]:
    """Widen each unit's span over the punctuation attached to it, for display and barge-in text.

    Dropped non-space characters after a unit join it ("Sure," / "好，"); dropped characters that
    open a whitespace-separated word join the unit that follows ("(hello"). Whitespace never joins.
    Spans never overlap and keep the units' order.
    """
    spans: list[tuple[int, int]] = []
    for index, unit in enumerate(units):
        start, end = unit.char_start, unit.char_end
        floor = spans[-1][1] if spans else 0
        while start > floor and not text[start - 1].isspace():
            start -= 1
        ceiling = units[index + 1].char_start if index + 1 < len(units) else len(text)
        while end < ceiling and not text[end].isspace() and not is_kept_char(text[end]):
            end += 1
        spans.append((start, end))
    return spans


# --------------------------------------------------------------------------- front door


class UnitSplitter:
    """Splits text into aligner units per language, as the Qwen3 forced aligner expects."""

    def __init__(
        self,
        japanese: Segmenter | None = None,
        korean_dictionary: Mapping[str, float] | None = None,
    ) -> None:
        self._japanese = japanese
        self._korean = korean_dictionary

    def words(self, text: str, language: str) -> list[str]:
        name = canonical_language(language)
        if name == "japanese":
            if self._japanese is None:
                self._japanese = nagisa_segmenter()
            return split_japanese(text, self._japanese)
        if name == "korean":
            return split_korean(text, self._korean)
        return split_spaced(text)

    def units(self, text: str, language: str) -> list[Unit]:
        return locate_units(text, self.words(text, language))
