"""What the session protocol asks of its caller: messages and packets to send, engine calls to
make, the socket to close, a paused stream's audio to take back or release, a tick to schedule.

The caller (gateway.session, gateway.twilio) runs the actions in order. Two send lanes: *control*
messages go out ahead of queued audio; the *audio* lane carries packets and each utterance's
`utterance.done` behind its last packet. `Purge(stream)` drops a stream's queued audio: with the
`utterance.interrupted` that follows on the control lane it forms the fence.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api import SynthesisRequest, TextSegment
from gateway.messages import ServerMessage
from gateway.packets import Packet


@dataclass(frozen=True, slots=True)
class SendControl:
    """A JSON message, sent ahead of queued audio."""

    message: ServerMessage


@dataclass(slots=True)
class SendAudio:
    """A chunk's packets, in order, for the audio lane (one action per chunk, not per packet)."""

    stream: int
    packets: list[Packet]


@dataclass(frozen=True, slots=True)
class SendTrailer:
    """A JSON message in the audio lane, after the stream's queued packets (utterance.done)."""

    stream: int
    message: ServerMessage


@dataclass(frozen=True, slots=True)
class Purge:
    """Drop every queued audio-lane item of this stream."""

    stream: int


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Call engine.open(request) and report back with open_succeeded / open_failed."""

    utterance_id: str
    request: SynthesisRequest


@dataclass(frozen=True, slots=True)
class PushText:
    utterance_id: str
    segment: TextSegment


@dataclass(frozen=True, slots=True)
class CloseText:
    utterance_id: str


@dataclass(frozen=True, slots=True)
class CancelStream:
    utterance_id: str


@dataclass(frozen=True, slots=True)
class Close:
    """Close the socket once the control messages before it are sent."""

    code: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Hold:
    """speak.pause: take every queued audio-lane item of this stream back, and hand its packets (in
    order) to `SessionProtocol.held`, saying whether its utterance.done was among them. Where the
    listener's own buffer was emptied too (Twilio's `clear`), the packets sent after the fence come
    back as well, the first one cut at the fence."""

    utterance_id: str
    stream: int


@dataclass(frozen=True, slots=True)
class Unhold:
    """speak.unpause: the stream goes on; under realtime pacing its clock restarts with the listener
    at `played_samples` now."""

    stream: int
    played_samples: int


@dataclass(frozen=True, slots=True)
class Throttle:
    """Stop (`on`) or resume taking this utterance's engine audio: meanwhile its chunks wait with
    its engine stream."""

    utterance_id: str
    on: bool


@dataclass(frozen=True, slots=True)
class WakeAt:
    """Call `tick` at this time (a pause's deadline)."""

    at: float


Action = (
    SendControl
    | SendAudio
    | SendTrailer
    | Purge
    | OpenStream
    | PushText
    | CloseText
    | CancelStream
    | Close
    | Hold
    | Unhold
    | Throttle
    | WakeAt
)
