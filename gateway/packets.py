"""Engine audio -> wire packets: streaming resampler, encoders, and the fixed-size packetiser.

The engine's float32 audio at its own rate goes through one stateful soxr stream per utterance
(so packet and chunk edges never click), is cut into `packet_ms` packets on the utterance's output
sample timeline, and encoded: pcm_s16le, pcm_f32le, or G.711 mulaw / alaw (8 kHz only). Each push
encodes the audio of all the packets it makes in one call; int16 engine audio at the output rate
is the pcm_s16le payload as it is. A packet leaves the packetiser with its bytes.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Final, cast

import numpy as np
import numpy.typing as npt
import soxr

from engine.api import float_samples, pcm16
from gateway.messages import (
    BYTES_PER_SAMPLE,
    FLAG_LAST,
    HEADER_BYTES,
    PROTOCOL_VERSION,
    TELEPHONY_ENCODINGS,
    Encoding,
    OutputInfo,
    PacketHeader,
    validate_output,
)

Audio = npt.NDArray[np.float32]
Pcm = npt.NDArray[np.int16]
_EMPTY: Final = np.zeros(0, dtype=np.float32)
_EMPTY_PCM: Final = np.zeros(0, dtype=np.int16)
_PACK_HEADER: Final = struct.Struct("<BBHII").pack  # PacketHeader.pack's layout, without the object
_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_FLOAT32: Final = np.dtype(np.float32)  # native float32 (numpy keeps one instance of it)


@dataclass(frozen=True, slots=True)
class OutputFormat:
    encoding: Encoding = "pcm_s16le"
    sample_rate: int = 24_000
    packet_ms: int = 20

    def __post_init__(self) -> None:
        validate_output(self.encoding, self.sample_rate, self.packet_ms)

    @property
    def samples_per_packet(self) -> int:
        return self.sample_rate * self.packet_ms // 1000

    @property
    def bytes_per_sample(self) -> int:
        return BYTES_PER_SAMPLE[self.encoding]

    def to_wire(self) -> OutputInfo:
        return {
            "encoding": self.encoding,
            "sample_rate": self.sample_rate,
            "packet_ms": self.packet_ms,
            "samples_per_packet": self.samples_per_packet,
        }


def is_mono_float32(samples: object) -> bool:
    """Already what the pipeline works on: a 1-D float32 ndarray (no conversion needed)."""
    return type(samples) is np.ndarray and samples.dtype is _FLOAT32 and samples.ndim == 1


# -- resampling -------------------------------------------------------------------------------


class StreamResampler:
    """Stateful float32 mono resampler; identity when the rates match."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32")
        )

    def process(self, samples: Audio, last: bool = False) -> Audio:
        if self._stream is None and is_mono_float32(samples):
            return samples
        x = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if self._stream is None:
            return x
        out = self._stream.resample_chunk(x, last=last)
        return np.ascontiguousarray(out, dtype=np.float32).reshape(-1)


# -- encoders ---------------------------------------------------------------------------------

_MULAW_BIAS: Final = 0x84
_MULAW_CLIP: Final = 32635  # largest magnitude before the top segment


to_int16: Final = pcm16  # the engine contract's float -> int16 PCM, the one the workers apply


def mulaw_encode(pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.uint8]:
    """G.711 mu-law of 16-bit PCM (the classic 14-bit formulation)."""
    v = pcm.astype(np.int32) >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), _MULAW_CLIP >> 2) + (_MULAW_BIAS >> 2)
    segment = np.zeros_like(v)
    for bound in (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF):
        segment += v > bound
    value = (segment << 4) | ((v >> (segment + 1)) & 0x0F)
    codes: npt.NDArray[np.uint8] = ((value ^ mask) & 0xFF).astype(np.uint8)
    return codes


def mulaw_decode(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.int16]:
    u = ~codes.astype(np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    magnitude = (((u & 0x0F) << 3) + _MULAW_BIAS) << exponent
    return np.where(u & 0x80, _MULAW_BIAS - magnitude, magnitude - _MULAW_BIAS).astype(np.int16)


def alaw_encode(pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.uint8]:
    """G.711 A-law of 16-bit PCM."""
    v = pcm.astype(np.int32) >> 3  # 13-bit
    mask = np.where(v >= 0, 0xD5, 0x55)
    v = np.where(v >= 0, v, -v - 1)
    segment = np.zeros_like(v)
    for bound in (0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF):
        segment += v > bound
    shift = np.maximum(segment, 1)
    value = (segment << 4) | ((v >> shift) & 0x0F)
    value = np.where(v > 0xFFF, 0x7F, value)
    return ((value ^ mask) & 0xFF).astype(np.uint8)


def alaw_decode(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.int16]:
    a = codes.astype(np.int32) ^ 0x55
    segment = (a & 0x70) >> 4
    t = ((a & 0x0F) << 4) + 8
    t = np.where(segment > 0, (t + 0x100) << np.maximum(segment - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


# G.711 of every int16 value, indexed by its bits: a packet's codes in one lookup
_EVERY_PCM: Final = np.arange(1 << 16, dtype=np.uint16).view(np.int16)
_G711: Final = {"mulaw": mulaw_encode(_EVERY_PCM), "alaw": alaw_encode(_EVERY_PCM)}


def encode_samples(samples: Audio, encoding: Encoding) -> bytes:
    if encoding == "pcm_f32le":
        clipped = np.maximum(samples, -1.0)
        np.minimum(clipped, 1.0, out=clipped)
        return clipped.tobytes() if _LITTLE_ENDIAN else clipped.astype("<f4").tobytes()
    pcm = to_int16(samples)
    if encoding == "pcm_s16le":
        return pcm.tobytes() if _LITTLE_ENDIAN else pcm.astype("<i2").tobytes()
    return _G711[encoding][pcm.view(np.uint16)].tobytes()


def decode_payload(payload: bytes, encoding: Encoding) -> Audio:
    """Bytes of one encoding back to float32 in [-1, 1] (clients and tests)."""
    if encoding == "pcm_f32le":
        return np.frombuffer(payload, dtype="<f4").astype(np.float32)
    codes = np.frombuffer(payload, dtype=np.uint8)
    if encoding == "pcm_s16le":
        pcm = np.frombuffer(payload, dtype="<i2")
    elif encoding == "mulaw":
        pcm = mulaw_decode(codes)
    else:
        pcm = alaw_decode(codes)
    return (pcm.astype(np.float32) / 32768.0).astype(np.float32)


# -- packetiser -------------------------------------------------------------------------------


class Packet:
    """One wire packet: the header fields as plain attributes for the send path, and its frame (the
    12-byte header, then the encoded payload)."""

    __slots__ = ("stream", "seq", "sample_offset", "flags", "samples", "frame")

    def __init__(
        self, stream: int, seq: int, sample_offset: int, flags: int, samples: int, frame: bytes
    ) -> None:
        self.stream = stream
        self.seq = seq
        self.sample_offset = sample_offset
        self.flags = flags
        self.samples = samples  # samples at the output rate in the payload
        self.frame = frame

    @property
    def header(self) -> PacketHeader:
        return PacketHeader(self.stream, self.seq, self.sample_offset, self.flags)

    @property
    def payload(self) -> bytes:
        return self.frame[HEADER_BYTES:]

    @property
    def end_sample(self) -> int:
        return self.sample_offset + self.samples

    @property
    def last(self) -> bool:
        return bool(self.flags & FLAG_LAST)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Packet) and (self.frame, self.samples) == (other.frame, other.samples)

    def __hash__(self) -> int:
        return hash((self.frame, self.samples))

    def __repr__(self) -> str:
        return (
            f"Packet(stream={self.stream}, seq={self.seq}, sample_offset={self.sample_offset}, "
            f"flags={self.flags}, samples={self.samples}, bytes={len(self.frame) - HEADER_BYTES})"
        )


class Packetiser:
    """One utterance's engine audio -> numbered packets of `packet_ms` (the last may be shorter;
    it is empty only when the audio ended exactly on a packet edge). Each push encodes the audio of
    the packets it makes in one call, and cuts their frames from it."""

    def __init__(self, stream: int, fmt: OutputFormat, input_rate: int) -> None:
        if fmt.encoding in TELEPHONY_ENCODINGS and fmt.sample_rate != 8000:
            raise ValueError(f"{fmt.encoding} is 8000 Hz only")
        self.stream = stream
        self.format = fmt
        self._size = fmt.samples_per_packet
        self._width = fmt.bytes_per_sample
        self._encoding = fmt.encoding
        self._resampler = StreamResampler(input_rate, fmt.sample_rate)
        # int16 engine audio is the payload itself when nothing is to be resampled or re-encoded
        self._pcm_as_is = fmt.encoding == "pcm_s16le" and input_rate == fmt.sample_rate and _LITTLE_ENDIAN
        self._pending: Audio = _EMPTY
        self._pending_pcm: Pcm = _EMPTY_PCM  # int16 audio short of a packet
        self.samples_out = 0  # output samples packetised so far
        self.packets = 0
        self.finished = False

    def push(self, samples: Audio | Pcm, final: bool = False) -> list[Packet]:
        """Packets of `samples` (float32 in [-1, 1], or int16 PCM), and what was left before them."""
        if self.finished:
            raise RuntimeError("the packetiser has already sent its last packet")
        if samples.dtype == np.int16:
            pcm = cast(Pcm, samples)
            if self._pcm_as_is:
                return self._push_pcm(pcm, final)
            samples = float_samples(pcm)
        elif len(self._pending_pcm):  # float audio after int16 (an engine does not mix them)
            return self._push_pcm(to_int16(cast(Audio, samples)), final)
        resampled = self._resampler.process(cast(Audio, samples), last=final)
        pending = self._pending
        if not len(pending):
            pending = resampled
        elif len(resampled):
            pending = np.concatenate((pending, resampled))
        ready = len(pending) if final else len(pending) - len(pending) % self._size
        if ready < len(pending):
            self._pending, pending = pending[ready:], pending[:ready]
        else:
            self._pending = _EMPTY
        if not ready and not final:
            return []
        return self._cut(encode_samples(pending, self._encoding), ready, final)

    @property
    def duration_ms(self) -> int:
        return round(self.samples_out * 1000 / self.format.sample_rate)

    def _push_pcm(self, pcm: Pcm, final: bool) -> list[Packet]:
        """`push` for int16 PCM that is already the payload: nothing to encode."""
        pcm = np.ascontiguousarray(pcm.reshape(-1))
        if len(self._pending):  # float audio held from before (an engine does not mix them)
            self._pending_pcm, self._pending = to_int16(self._pending), _EMPTY
        pending = np.concatenate((self._pending_pcm, pcm)) if len(self._pending_pcm) else pcm
        ready = len(pending) if final else len(pending) - len(pending) % self._size
        if ready < len(pending):
            self._pending_pcm, pending = pending[ready:], pending[:ready]
        else:
            self._pending_pcm = _EMPTY_PCM
        if not ready and not final:
            return []
        return self._cut(pending.data.cast("B"), ready, final)

    def _cut(self, payload: bytes | memoryview, samples: int, final: bool) -> list[Packet]:
        """The packets of `samples` output samples, `payload` their encoded bytes: whole packets and,
        when `final`, the rest (up to a whole packet, maybe none) as the last."""
        size, stream, seq, offset = self._size, self.stream, self.packets, self.samples_out
        whole = samples // size
        if final and whole * size == samples and whole:
            whole -= 1  # the very last one goes out below, flagged as last
        step = size * self._width
        data = memoryview(payload) if len(payload) > step else payload  # slices of it, not copies
        out: list[Packet] = []
        for i in range(whole):
            head = _PACK_HEADER(PROTOCOL_VERSION, 0, stream, seq & 0xFFFFFFFF, offset & 0xFFFFFFFF)
            out.append(Packet(stream, seq, offset, 0, size, head + data[i * step : (i + 1) * step]))
            seq += 1
            offset += size
        if final:
            rest = samples - whole * size
            head = _PACK_HEADER(PROTOCOL_VERSION, FLAG_LAST, stream, seq & 0xFFFFFFFF, offset & 0xFFFFFFFF)
            out.append(Packet(stream, seq, offset, FLAG_LAST, rest, head + data[whole * step :]))
            seq += 1
            offset += rest
            self.finished = True
        self.packets, self.samples_out = seq, offset
        return out
