"""One utterance on the phone line: what the line knows of it (its queue of frames, what was sent,
where its words end), and the marks that follow its frames.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.api import SynthesisStream
from gateway.packets import Packet

BargeInBy = Literal["caller", "agent"]


class UtteranceDone:
    """utterance.done in a line's queue, behind its last frame."""

    __slots__ = ("message",)

    def __init__(self, message: Mapping[str, Any]) -> None:
        self.message = message


@dataclass(eq=False, slots=True)
class PhoneUtterance:
    """What the line knows of one utterance; its life (text, words, pause, barge-in) is the
    session protocol's."""

    utterance_id: str
    stream: int
    engine_stream: SynthesisStream
    pull: asyncio.Task[None] | None = None
    gate: asyncio.Event | None = None  # while throttled: the engine's chunks wait for it
    queue: deque[Packet | UtteranceDone] = field(default_factory=deque)  # for Twilio, in order
    sent: deque[Packet] = field(default_factory=deque)  # sent, not yet known to be heard
    word_ends: list[int] = field(default_factory=list)  # each word's end, in 8 kHz samples
    next_mark: int = 0  # the next word to mark
    on_line: bool = False  # audio of it is in Twilio's buffer (sent since the last clear)
    all_sent: bool = False  # the last frame and the end mark are sent
    state: Literal["active", "played", "interrupted", "failed"] = "active"
    paused: bool = False
    fence: int | None = None  # a pause that cleared Twilio's buffer: audio from here is sent again
    by: BargeInBy = "agent"  # who stopped it last
    heard_index: int = -1  # the last word whose mark came back before any clear
    anchor: tuple[int, float] | None = None  # the caller was at this 8 kHz sample then, and plays on
    resume_from: int = 0  # where playing starts (again, after a pause)
    sent_samples: int = 0  # the end of the last frame sent
    report: dict[str, Any] | None = None  # its utterance.interrupted, as the agent got it
    first_text_at: float | None = None  # loop time of its first text
    ttfa_counted: bool = False  # its first frame went out and its time to first audio is counted

    @property
    def live(self) -> bool:
        return self.state == "active"


def mark_name(utterance_id: str, index: int | None) -> str:
    return f"{utterance_id}/end" if index is None else f"{utterance_id}/w{index}"


@dataclass(frozen=True, slots=True)
class Mark:
    utterance: PhoneUtterance
    index: int | None  # the word, or None: the utterance's end
    position: int  # 8 kHz samples of the utterance played when it comes back
