"""Languages in the client's text: `<zh>购买</zh><en>iPhone 15</en>` tags, and the "Auto" rule.

Tags: `<code>` opens a span, `</code>` closes it; `code` is an ISO 639-1 code, optionally with a
region (`zh`, `en-US`, `pt-BR`) or an English language name (`<chinese>`), case-insensitive.
Spans nest; a close tag ends the innermost open span of its language (and any opened inside it);
a close tag with no open span is dropped. Anything else that looks like markup (`<b>`, `a < b`)
is text. Tags are removed from what is spoken, and every spoken character keeps its offset in the
text as the client sent it, so word `char_*` spans still point there.

Tags may arrive split across appends (`"<e"` then `"n>"`): the tagger holds back a tail that could
still become a tag, at most `MAX_TAG_CHARS`, until the next text or the end.

Auto rule (`detect_language`), per segment, from the letters it holds:
  1. any kana -> Japanese;  2. Hangul outnumbering Han -> Korean;
  3. any Han, when Han characters are at least a quarter of the Latin letters -> Chinese
     ("请帮我订一台 iPhone 15" is Chinese);
  4. Cyrillic outnumbering Latin -> Russian;
  5. Latin: the language whose marks (ß ä ö ü, ç è ê, ñ ¿ ¡, ã õ, ...) and common short words score
     highest among German, French, Spanish, Portuguese and Italian, when they score at least 2;
     otherwise English;
  6. no letters at all (digits, punctuation) -> None: the previous segment's language is kept.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

# the ten Qwen3-TTS languages, by the names the engines take
LANGUAGE_NAMES: Final = (
    "Chinese",
    "English",
    "Japanese",
    "Korean",
    "German",
    "French",
    "Russian",
    "Portuguese",
    "Spanish",
    "Italian",
)
CODES: Final[dict[str, str]] = {
    "zh": "Chinese",
    "en": "English",
    "ja": "Japanese",
    "ko": "Korean",
    "de": "German",
    "fr": "French",
    "ru": "Russian",
    "pt": "Portuguese",
    "es": "Spanish",
    "it": "Italian",
    "cmn": "Chinese",
    "jp": "Japanese",
}
MAX_TAG_CHARS: Final = 24
_TAG: Final = re.compile(r"<(/?)([A-Za-z]{2,12})(?:[-_][A-Za-z0-9]{1,8})?>")
_TAG_PREFIX: Final = re.compile(r"</?[A-Za-z]{0,12}(?:[-_][A-Za-z0-9]{0,8})?$")


def language_of_tag(name: str) -> str | None:
    """The language a tag name selects, or None when it is not a language tag."""
    key = name.lower()
    if key in CODES:
        return CODES[key]
    for language in LANGUAGE_NAMES:
        if key == language.lower():
            return language
    return None


def normalise_language(value: str | None) -> str:
    """A session or request language as the engines take it: a known name or code becomes the
    canonical name ("en-US" -> "English"), "auto" / empty -> "Auto"; anything else is passed on."""
    if not value or value.lower() == "auto":
        return "Auto"
    base = re.split(r"[-_]", value, maxsplit=1)[0]
    return language_of_tag(value) or language_of_tag(base) or value


@dataclass(frozen=True, slots=True)
class Run:
    """Spoken text of one language span; offsets[i] is text[i]'s offset in the client's text."""

    language: str | None  # None: untagged (the session's language applies)
    text: str
    offsets: tuple[int, ...]


class LanguageTagger:
    """Client text in (incrementally), language runs with tags removed out."""

    def __init__(self, start_offset: int = 0, open_languages: Sequence[str] = ()) -> None:
        self._pending = ""  # received, not yet parsed (a possible partial tag)
        self._pending_at = start_offset  # client offset of _pending[0]
        self._stack: list[str] = list(open_languages)

    @property
    def language(self) -> str | None:
        return self._stack[-1] if self._stack else None

    @property
    def open_languages(self) -> tuple[str, ...]:
        return tuple(self._stack)

    def feed(self, text: str) -> list[Run]:
        self._pending += text
        return self._parse(final=False)

    def flush(self) -> list[Run]:
        return self._parse(final=True)

    def _parse(self, final: bool) -> list[Run]:
        runs: list[Run] = []
        text, base = self._pending, self._pending_at
        chars: list[str] = []
        offsets: list[int] = []

        def close_run() -> None:
            if chars:
                runs.append(Run(self.language, "".join(chars), tuple(offsets)))
                chars.clear()
                offsets.clear()

        i = 0
        while i < len(text):
            lt = text.find("<", i)
            literal_end = len(text) if lt < 0 else lt
            chars.extend(text[i:literal_end])
            offsets.extend(range(base + i, base + literal_end))
            i = literal_end
            if lt < 0:
                break
            match = _TAG.match(text, lt)
            language = language_of_tag(match.group(2)) if match else None
            if match and language:
                close_run()
                self._apply(language, closing=bool(match.group(1)))
                i = match.end()
                continue
            tail = text[lt:]
            if not final and ">" not in tail and len(tail) <= MAX_TAG_CHARS and _TAG_PREFIX.match(tail):
                break  # may still become a tag: wait for more text
            chars.append("<")
            offsets.append(base + lt)
            i = lt + 1
        close_run()
        self._pending, self._pending_at = text[i:], base + i
        return runs

    def _apply(self, language: str, closing: bool) -> None:
        if not closing:
            self._stack.append(language)
        elif language in self._stack:
            depth = len(self._stack) - 1 - self._stack[::-1].index(language)
            del self._stack[depth:]


def languages_open_at(text: str, offset: int) -> tuple[str, ...]:
    """The tag spans open at `offset` of a client text (to resume from the middle of it)."""
    tagger = LanguageTagger()
    tagger.feed(text[:offset])
    return tagger.open_languages


# -- the Auto rule -----------------------------------------------------------------------------

_MARKS: Final[dict[str, str]] = {
    "German": "ßäöüÄÖÜ",
    "French": "çèêëîïôûœÇÈÊÎÔŒ",
    "Spanish": "ñ¿¡Ñ",
    "Portuguese": "ãõÃÕ",
    "Italian": "ìòÌÒ",
}
_WORDS: Final[dict[str, frozenset[str]]] = {
    "German": frozenset("der die das und ist nicht ich sie ein eine mit auf für ja nein wir".split()),
    "French": frozenset("le la les et est une des pas je vous nous avec pour oui non sur".split()),
    "Spanish": frozenset("el los las es una por para con pero sí está muy hola gracias".split()),
    "Portuguese": frozenset("os as uma não com para por sim obrigado você está muito olá".split()),
    "Italian": frozenset("il lo gli della sono una non per con sì grazie ciao questo che".split()),
    "English": frozenset("the and is are you to of it this that with for was have".split()),
}
_LATIN_WORD: Final = re.compile(r"[^\W\d_]+")


def _script_counts(text: str) -> tuple[int, int, int, int, int]:
    kana = hangul = han = cyrillic = latin = 0
    for ch in text:
        code = ord(ch)
        if (
            0x3040 <= code <= 0x30FF or 0x31F0 <= code <= 0x31FF or 0xFF66 <= code <= 0xFF9D
        ) and ch.isalpha():
            kana += 1  # letters only: Chinese writes names with the katakana middle dot too (哈利・波特)
        elif 0xAC00 <= code <= 0xD7AF or 0x1100 <= code <= 0x11FF or 0x3130 <= code <= 0x318F:
            hangul += 1
        elif (
            0x4E00 <= code <= 0x9FFF
            or 0x3400 <= code <= 0x4DBF
            or 0xF900 <= code <= 0xFAFF
            or 0x20000 <= code <= 0x3FFFF  # the CJK extension planes; emoji tag sequences lie beyond
        ):
            han += 1
        elif 0x0400 <= code <= 0x04FF:
            cyrillic += 1
        elif ch.isalpha() and unicodedata.name(ch, "").startswith("LATIN"):
            latin += 1
    return kana, hangul, han, cyrillic, latin


def detect_language(text: str) -> str | None:
    """The language the Auto rule picks for a segment (module docstring), None without letters."""
    kana, hangul, han, cyrillic, latin = _script_counts(text)
    if kana:
        return "Japanese"
    if hangul and hangul >= han:
        return "Korean"
    if han and han * 4 >= latin:
        return "Chinese"
    if cyrillic and cyrillic > latin:
        return "Russian"
    if not latin:
        return None
    scores = dict.fromkeys(_WORDS, 0)
    for language, marks in _MARKS.items():
        scores[language] += 2 * sum(text.count(m) for m in marks)
    for word in _LATIN_WORD.findall(text.lower()):
        for language, common in _WORDS.items():
            if word in common:
                scores[language] += 1
    best = max(scores, key=lambda k: scores[k])
    if best != "English" and scores[best] >= 2 and scores[best] > scores["English"]:
        return best
    return "English"
