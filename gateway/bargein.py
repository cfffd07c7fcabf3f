"""Barge-in: from a played position to the last word heard (protocol "Barge-in rules").

- `last_word`: the last word with end_ms <= played_ms + 40 (word ends include coarticulation).
- `partial_word`: the word being spoken at played_ms (start_ms <= played_ms < end_ms), if it is
  not already the last word.
- `spoken_text` runs to last_word.char_end; `unspoken_text` is the rest of the utterance's text.
- The position comes from the cancel message ("client"), else the last playback.report
  extrapolated at real time and capped at what was sent ("report"), else the server's own clock
  from the first packet sent, capped at what was sent ("server"). After a pause the server's clock
  runs from the paused position, from the moment of the unpause (from the first packet when none
  had been sent by then).
- A caller that knows which words were heard (Twilio's marks) bounds `last_word` by that index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gateway.messages import PositionSource, Word

END_TOLERANCE_MS: Final = 40


@dataclass(frozen=True, slots=True)
class Report:
    """A playback.report: the client had played `played_ms` at server time `at` (seconds)."""

    played_ms: int
    at: float


@dataclass(frozen=True, slots=True)
class Cut:
    last_word: Word | None
    partial_word: Word | None
    spoken_text: str
    unspoken_text: str


def played_position(
    *,
    client_ms: int | None,
    report: Report | None,
    first_sent_at: float | None,
    sent_ms: int,
    now: float,
    start_ms: int = 0,
) -> tuple[int, PositionSource]:
    """The played position (ms) and where it came from, in the protocol's order of preference.
    `start_ms` is where the listener was at `first_sent_at` (not 0 once a pause has ended)."""
    if client_ms is not None:
        return max(0, min(client_ms, sent_ms)), "client"
    if report is not None:
        extrapolated = report.played_ms + max(0.0, now - report.at) * 1000.0
        return max(0, min(round(extrapolated), sent_ms)), "report"
    if first_sent_at is None:
        return min(start_ms, sent_ms), "server"
    elapsed = start_ms + max(0.0, now - first_sent_at) * 1000.0
    return max(0, min(round(elapsed), sent_ms)), "server"


def cut_at(words: Sequence[Word], text: str, played_ms: int, heard_index: int | None = None) -> Cut:
    """Split the utterance at `played_ms`. `words` are in timeline order. With `heard_index`, no
    word after that one counts as heard."""
    last: Word | None = None
    for word in words:
        if word.end_ms <= played_ms + END_TOLERANCE_MS and (heard_index is None or word.index <= heard_index):
            last = word
    partial: Word | None = None
    for word in words:
        if word.start_ms <= played_ms < word.end_ms and (last is None or word.index > last.index):
            partial = word
            break
    split = last.char_end if last is not None else 0
    return Cut(last, partial, text[:split], text[split:])


def resume_offset(words: Sequence[Word], text: str, cut: Cut) -> int:
    """Where, in `text`, the unheard part starts: the first unspoken word (a partial word counts
    as unspoken), or past the whitespace after the last word when no later word is timed yet."""
    if cut.partial_word is not None:
        return cut.partial_word.char_start
    last_index = cut.last_word.index if cut.last_word is not None else -1
    later = [w for w in words if w.index > last_index]
    if later:
        return min(w.char_start for w in later)
    i = cut.last_word.char_end if cut.last_word is not None else 0
    while i < len(text) and (text[i].isspace() or text[i] in ",.;:!?，。、；：！？"):
        i += 1
    return i
