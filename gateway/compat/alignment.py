"""Word times -> per-character times, as ElevenLabs' `alignment` carries them.

The native session times words (start, end, and their span in the client's text); a character
of a word gets an equal share of the word's time, and the characters between two words (spaces,
punctuation) share the pause between them, so every character of the text is covered once and in
order. Times are integer milliseconds, in blocks: each block holds the characters timed since the
last one. `relative=False` puts a block's times on the context's timeline (as LiveKit's plugin
reads them); `relative=True` makes them relative to where the previous block's last character
ended (as Pipecat reads them: it adds up each block's last start plus duration).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class CharTimeline:
    def __init__(self, relative: bool) -> None:
        self.relative = relative
        self.text = ""
        self._upto = 0  # characters of `text` timed so far
        self._end_ms = 0  # where the last timed character ends
        self._base_ms = 0  # where the last block ended (relative blocks count from here)
        self._pending: list[tuple[str, int, int]] = []  # (character, start ms, duration ms)

    def add_text(self, text: str) -> None:
        self.text += text

    def add_words(self, words: Iterable[Mapping[str, Any]]) -> None:
        """Native `words` entries (start_ms, end_ms, char_start, char_end)."""
        for word in words:
            c0, c1 = int(word["char_start"]), int(word["char_end"])
            if c0 < self._upto or c1 > len(self.text) or c1 <= c0:
                continue
            start = max(int(word["start_ms"]), self._end_ms)
            end = max(int(word["end_ms"]), start)
            self._spread(self.text[self._upto : c0], self._end_ms, start)
            self._spread(self.text[c0:c1], start, end)
            self._upto, self._end_ms = c1, end

    def finish(self, end_ms: int) -> None:
        """The rest of the text (trailing punctuation, spaces) up to the end of the audio, ending
        in a space: a reader that takes a word as complete at the space after it (Pipecat) then
        times the last word too."""
        rest = self.text[self._upto :]
        if self.text and not self.text[-1].isspace():
            rest += " "
        self._spread(rest, self._end_ms, max(end_ms, self._end_ms))
        self._upto = len(self.text)

    def take(self) -> dict[str, list[Any]] | None:
        """The characters timed since the last call, as an alignment object; None if none."""
        if not self._pending:
            return None
        base = self._base_ms if self.relative else 0
        block: dict[str, list[Any]] = {
            "chars": [c for c, _, _ in self._pending],
            "charStartTimesMs": [s - base for _, s, _ in self._pending],
            "charDurationsMs": [d for _, _, d in self._pending],
        }
        _, start, duration = self._pending[-1]
        self._base_ms = start + duration
        self._pending.clear()
        return block

    def _spread(self, chars: str, start: int, end: int) -> None:
        n = len(chars)
        for i, char in enumerate(chars):
            a = start + (end - start) * i // n
            b = start + (end - start) * (i + 1) // n
            self._pending.append((char, a, b - a))
