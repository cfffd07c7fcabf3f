"""`WS /v1/twilio`: a target for Twilio `<Connect><Stream>` bidirectional Media Streams, and the
agent's control channel `WS /v1/twilio/control/{callSid}` (docs/twilio.md).

Twilio sends connected / start / media (inbound μ-law 8 kHz) / mark / dtmf / stop; we send μ-law
8 kHz `media` in 20 ms frames, a `mark` after the frame in which each word ends (and one at the end
of each utterance), and `clear` on barge-in. Twilio echoes a mark when the audio before it has
played, and on `clear` it echoes every mark still buffered: so the last word heard is the last
word whose mark came back *before* we decided to clear; marks arriving after that prove nothing
and are ignored.

Barge-in comes from the caller (an energy VAD on the inbound audio, with a threshold, an attack
and a hang time) or from the agent (`speak.cancel`). The agent speaks with the `/v1/stream`
vocabulary (session.start, speak.append / flush / end / cancel / pause / unpause) and hears back
the call's events.

The call's utterances live in the same sans-I/O `SessionProtocol` as a `/v1/stream` session: the
marks that come back are its playback reports, `clear` is its fence, and after a pause that
cleared Twilio's buffer the audio from the fence on is handed back to it, to be sent again at the
unpause.

The modules: `media` (the wire: μ-law frames, the events we send, the caller's audio), `vad` (the
inbound VAD and the per-call options), `line` (one utterance on the line, and its marks), `call`
(one call, built of `call_state`, `playout`, `barge_in` and `call_actions`), `endpoints` (the two
WebSocket endpoints and the calls in progress).
"""

from gateway.twilio.call import Call
from gateway.twilio.call_state import AgentSink
from gateway.twilio.endpoints import CLOSE_POLICY, AgentFrame, CallRouter, TwilioGateway, next_agent_frame
from gateway.twilio.line import BargeInBy, PhoneUtterance, mark_name
from gateway.twilio.media import FRAME_MS, FRAME_SAMPLES, RATE
from gateway.twilio.vad import EnergyVad, TwilioOptions, frame_dbfs

__all__ = [
    "CLOSE_POLICY",
    "FRAME_MS",
    "FRAME_SAMPLES",
    "RATE",
    "AgentFrame",
    "AgentSink",
    "BargeInBy",
    "Call",
    "CallRouter",
    "EnergyVad",
    "PhoneUtterance",
    "TwilioGateway",
    "TwilioOptions",
    "frame_dbfs",
    "mark_name",
    "next_agent_frame",
]
