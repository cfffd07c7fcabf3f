"""The session state machine, without I/O: client frames, engine chunks and send confirmations in;
actions out (messages and packets to send, engine calls to make, the socket to close).

One module per responsibility: `actions` (what the protocol asks of its caller, and the two send
lanes), `utterance` (one utterance's state and life), `state` (the session's utterances and the
steps of their life every part shares), `admission` (opening an utterance), `playback` (where the
listener is), `fences` (barge-in and pause), `engine_feedback` (the engine's audio and its end),
`session_protocol` (the client's messages, timeouts, shutdown: `SessionProtocol`, built of the
others). No module here does I/O: the callers (gateway.session, gateway.twilio) do.
"""

from gateway.protocol.actions import (
    Action,
    CancelStream,
    Close,
    CloseText,
    Hold,
    OpenStream,
    Purge,
    PushText,
    SendAudio,
    SendControl,
    SendTrailer,
    Throttle,
    Unhold,
    WakeAt,
)
from gateway.protocol.session_protocol import SessionProtocol
from gateway.protocol.utterance import Pause, Status, Utterance

__all__ = [
    "Action",
    "CancelStream",
    "Close",
    "CloseText",
    "Hold",
    "OpenStream",
    "Pause",
    "Purge",
    "PushText",
    "SendAudio",
    "SendControl",
    "SendTrailer",
    "SessionProtocol",
    "Status",
    "Throttle",
    "Unhold",
    "Utterance",
    "WakeAt",
]
