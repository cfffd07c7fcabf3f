"""One utterance as the session protocol knows it: its status, its text, words and figures, and
its pause.

Life of an utterance: OPEN (text accepted) -> TEXT_CLOSED (speak.end) -> GENERATED (last packet
made) -> DELIVERED (utterance.done sent); or INTERRUPTED / FAILED from any active state. Finished
utterances stay in a short history so that a late speak.cancel and speak.resume still work; a
retired utterance keeps its text, words and figures but not its resampler state.

Pausing is beside that life, not a step of it (gateway.protocol.fences): a `Pause` holds where the
listener stopped and what is kept for the unpause.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.api import SynthesisRequest, TextSegment
from gateway.bargein import Cut, Report
from gateway.messages import PositionSource, ServerMessage, UtterancePaused, Word
from gateway.packets import Packet, Packetiser
from gateway.segmenter import UtteranceText


class Status(enum.Enum):
    OPEN = "open"
    TEXT_CLOSED = "text_closed"
    GENERATED = "generated"
    DELIVERED = "delivered"
    INTERRUPTED = "interrupted"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        return self in _ACTIVE


# module constants: an enum member looked up through its class costs a dictionary walk per packet
_ACTIVE: tuple[Status, ...] = (Status.OPEN, Status.TEXT_CLOSED, Status.GENERATED)
RECEIVING: tuple[Status, ...] = (Status.OPEN, Status.TEXT_CLOSED)  # taking engine audio


@dataclass(slots=True)
class Pause:
    """A paused utterance: where the listener stopped, and what is kept for the unpause."""

    message: UtterancePaused  # the answer, again for a repeated speak.pause
    played_ms: int
    source: PositionSource
    heard_index: int | None  # the last word known to be heard (Twilio's marks), if known
    deadline: float  # when it becomes an interruption
    held: list[Packet] = field(default_factory=list)  # from the first sample after the fence
    held_samples: int = 0
    trailer: bool = False  # utterance.done waits behind the held packets
    throttled: bool = False  # the kept audio reached pause_buffer_ms
    withheld: list[TextSegment] = field(default_factory=list)  # text kept from the engine meanwhile
    close_withheld: bool = False  # and its speak.end


@dataclass(slots=True)
class Utterance:
    utterance_id: str
    stream: int
    segmenter: UtteranceText
    packetiser: Packetiser
    request: SynthesisRequest
    status: Status = Status.OPEN
    opened: bool = False  # the engine admitted it
    quota_held: bool = False  # counted in the key's utterances in progress
    last_text_at: float = 0.0  # when text last arrived (text_timeout_s)
    text: str = ""
    words: list[Word] = field(default_factory=list)
    engine_samples: int = 0  # engine-rate samples received
    sent_samples: int = 0  # output-rate samples sent to the client
    first_sent_at: float | None = None
    report: Report | None = None
    cut: Cut | None = None
    interrupted: ServerMessage | None = None
    resumed_from: str | None = None
    text_offset: int = 0
    pause: Pause | None = None
    clock: Report | None = None  # after an unpause: the listener went on from there, then

    @property
    def sent_ms(self) -> int:
        return round(self.sent_samples * 1000 / self.packetiser.format.sample_rate)
