"""Twilio Media Streams on the wire: μ-law at 8 kHz in 20 ms frames, each event a JSON message
naming the stream.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from gateway.messages import PacketHeader
from gateway.packets import Packet, mulaw_decode

RATE: Final = 8000
FRAME_MS: Final = 20
FRAME_SAMPLES: Final = RATE * FRAME_MS // 1000


def twilio_message(
    stream_sid: str | None, event: str, payload: bytes | None = None, name: str | None = None
) -> dict[str, Any]:
    """An event for Twilio: `media` (a frame of μ-law), `mark` (named), or `clear`."""
    message: dict[str, Any] = {"event": event, "streamSid": stream_sid}
    if payload is not None:
        message["media"] = {"payload": base64.b64encode(payload).decode("ascii")}
    if name is not None:
        message["mark"] = {"name": name}
    return message


def inbound_pcm(media: Mapping[str, Any]) -> npt.NDArray[np.int16] | None:
    """The caller's audio in a `media` event as 16-bit samples; None for another track, or for a
    payload that is not base64."""
    if media.get("track", "inbound") not in ("inbound", "inbound_track"):
        return None
    try:
        codes = np.frombuffer(base64.b64decode(str(media.get("payload", "")), validate=True), dtype=np.uint8)
    except (binascii.Error, ValueError):
        return None
    return mulaw_decode(codes)


def packet_from(packet: Packet, sample: int) -> Packet:
    """`packet` from `sample` of the utterance's timeline on (8 kHz μ-law: a byte a sample)."""
    cut = sample - packet.sample_offset
    if cut <= 0:
        return packet
    header = PacketHeader(packet.stream, packet.seq, sample, packet.flags)
    frame = header.pack() + packet.payload[cut:]
    return Packet(packet.stream, packet.seq, sample, packet.flags, packet.samples - cut, frame)
