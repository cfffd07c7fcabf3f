"""Engine audio -> wire packets: streaming resampler, encoders, and the fixed-size packetiser.

The engine's float32 audio at its own rate goes through one stateful soxr stream per utterance
(so packet and chunk edges never click), is cut into `packet_ms` packets on the utterance's output
sample timeline, and encoded: pcm_s16le, pcm_f32le, or G.711 mulaw / alaw (8 kHz only). Whole
packets are encoded lazily, all those of a thread together (one numpy pass per encoding) when the
first of them is read: on a gateway with many streams the packets of one event-loop pass share it.
"""

from __future__ import annotations

import struct
import sys
import threading
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


def encode_samples(samples: Audio, encoding: Encoding) -> bytes:
    if encoding == "pcm_f32le":
        return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
    pcm = to_int16(samples)
    if encoding == "pcm_s16le":
        return pcm.tobytes() if _LITTLE_ENDIAN else pcm.astype("<i2").tobytes()
    if encoding == "mulaw":
        return mulaw_encode(pcm).tobytes()
    return alaw_encode(pcm).tobytes()


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
    12-byte header, then the payload), built once. A packet made by `deferred` gets its payload
    encoded together with every other deferred packet of its thread when any of them is first read
    (`_EncodeBatch`), so the packets that all streams make in one event-loop pass cost one numpy
    pass instead of one each."""

    __slots__ = (
        "stream",
        "seq",
        "sample_offset",
        "flags",
        "samples",
        "_frame",
        "_head",
        "_audio",
        "_encoding",
    )
    _frame: bytes | None  # None until a deferred packet is encoded
    _head: bytes  # a deferred packet's header, until then
    _audio: Audio  # a deferred packet's samples, until then
    _encoding: Encoding

    def __init__(self, header: PacketHeader, payload: bytes, samples: int) -> None:
        self.stream, self.seq, self.sample_offset, self.flags = (
            header.stream,
            header.seq,
            header.sample_offset,
            header.flags,
        )
        self.samples = samples  # samples at the output rate in the payload
        self._frame = header.pack() + payload

    @classmethod
    def of_frame(
        cls, stream: int, seq: int, sample_offset: int, flags: int, samples: int, frame: bytes
    ) -> Packet:
        """A packet around a frame already built."""
        packet = cls.__new__(cls)
        packet.stream, packet.seq, packet.sample_offset, packet.flags = stream, seq, sample_offset, flags
        packet.samples, packet._frame = samples, frame
        return packet

    @classmethod
    def deferred(
        cls, stream: int, seq: int, sample_offset: int, head: bytes, audio: Audio, encoding: Encoding
    ) -> Packet:
        """A packet (not the last) whose payload is encoded from `audio` when first read. `audio` is
        not copied: like the packetiser's pending samples, it must not change after the engine
        handed it over (`Packetiser._defer_run` makes them the same way, inlined)."""
        packet = cls.__new__(cls)
        packet.stream, packet.seq, packet.sample_offset, packet.flags = stream, seq, sample_offset, 0
        packet.samples, packet._frame = len(audio), None
        packet._head, packet._audio, packet._encoding = head, audio, encoding
        _BATCH.add(packet)
        return packet

    @property
    def frame(self) -> bytes:
        frame = self._frame
        if frame is None:
            _BATCH.flush()
            frame = self._frame
            if frame is None:  # deferred by another thread: encoded on its own
                frame = self._frame = b"".join((self._head, encode_samples(self._audio, self._encoding)))
        return frame

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


class _EncodeBatch(threading.local):
    """This thread's deferred packets, encoded together (one pass per encoding) at the first read of
    any of them. At most `limit` wait: packets dropped unread (a purge) are let go by the next pass.
    pcm_s16le (the default) is encoded in buffers kept from pass to pass (up to `kept_samples`): a
    fresh array of a pass's size (hundreds of KB) comes from the kernel's zeroed pages each time,
    and those page faults cost more than the arithmetic."""

    limit: Final = 2048
    kept_samples: Final = 1 << 20  # the largest pass encoded in kept buffers (6 MB of them)

    def __init__(self) -> None:
        self.pending: list[Packet] = []
        self._float = np.zeros(0, dtype=np.float32)
        self._int16 = np.zeros(0, dtype=np.int16)

    def add(self, packet: Packet) -> None:
        self.pending.append(packet)
        if len(self.pending) >= self.limit:
            self.flush()

    def add_run(self, packets: list[Packet]) -> None:
        pending = self.pending
        pending += packets
        if len(pending) >= self.limit:
            self.flush()

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        groups: dict[Encoding, list[Packet]] = {}
        for packet in pending:
            if packet._frame is None:
                group = groups.get(packet._encoding)
                if group is None:
                    group = groups[packet._encoding] = []
                group.append(packet)
        for encoding, packets in groups.items():
            audio = [p._audio for p in packets]
            if encoding == "pcm_s16le" and _LITTLE_ENDIAN:
                data = self._s16le(audio)
            else:
                data = memoryview(encode_samples(np.concatenate(audio), encoding))
            width, start = BYTES_PER_SAMPLE[encoding], 0
            for p in packets:
                end = start + p.samples * width
                p._frame, p._audio = p._head + data[start:end], _EMPTY
                start = end

    def _s16le(self, audio: list[Audio]) -> memoryview:
        """`encode_samples(concatenated audio, "pcm_s16le")`, as a view of this batch's buffers
        (valid until the next pass)."""
        size = sum(map(len, audio))
        if size > self.kept_samples:  # e.g. packets piled up unread: not worth keeping buffers for
            return memoryview(encode_samples(np.concatenate(audio), "pcm_s16le"))
        if len(self._float) < size:
            self._float = np.zeros(min(max(size, 2 * len(self._float)), self.kept_samples), dtype=np.float32)
            self._int16 = np.zeros(len(self._float), dtype=np.int16)
        scaled, pcm = self._float[:size], self._int16[:size]
        np.concatenate(audio, out=scaled)
        # to_int16 in four passes over the batch: clip, scale, and round straight into the int16
        # buffer (a pass's fixed cost is nothing beside its length here, unlike a single packet's)
        np.clip(scaled, -1.0, 1.0, out=scaled)
        np.multiply(scaled, 32767.0, out=scaled)
        np.rint(scaled, out=pcm, casting="unsafe")
        return pcm.data.cast("B")


_BATCH: Final = _EncodeBatch()


class Packetiser:
    """One utterance's engine audio -> numbered packets of `packet_ms` (the last may be shorter;
    it is empty only when the audio ended exactly on a packet edge)."""

    def __init__(self, stream: int, fmt: OutputFormat, input_rate: int) -> None:
        if fmt.encoding in TELEPHONY_ENCODINGS and fmt.sample_rate != 8000:
            raise ValueError(f"{fmt.encoding} is 8000 Hz only")
        self.stream = stream
        self.format = fmt
        self._size = fmt.samples_per_packet
        self._encoding = fmt.encoding
        self._resampler = StreamResampler(input_rate, fmt.sample_rate)
        # int16 engine audio is the payload itself when nothing is to be resampled or re-encoded
        self._pcm_as_is = fmt.encoding == "pcm_s16le" and input_rate == fmt.sample_rate and _LITTLE_ENDIAN
        self._pending: Audio = _EMPTY
        self._pending_pcm: npt.NDArray[np.int16] = _EMPTY_PCM  # int16 audio short of a packet
        self.samples_out = 0  # output samples packetised so far
        self.packets = 0
        self.finished = False

    def push(self, samples: Audio | npt.NDArray[np.int16], final: bool = False) -> list[Packet]:
        """Packets of `samples` (float32 in [-1, 1], or int16 PCM), and what was left before them."""
        if self.finished:
            raise RuntimeError("the packetiser has already sent its last packet")
        if samples.dtype == np.int16:
            pcm = cast(npt.NDArray[np.int16], samples)
            if self._pcm_as_is:
                return self._push_pcm(pcm, final)
            samples = float_samples(pcm)
        elif len(self._pending_pcm):  # float audio after int16 (an engine does not mix them)
            return self._push_pcm(to_int16(cast(Audio, samples)), final)
        resampled = self._resampler.process(cast(Audio, samples), last=final)
        if not final and len(resampled) == self._size and not len(self._pending):  # one whole packet
            return [self._defer(resampled)]
        if len(resampled):
            self._pending = np.concatenate((self._pending, resampled)) if len(self._pending) else resampled
        pending = self._pending
        size = self.format.samples_per_packet
        out: list[Packet] = []
        count = len(pending) // size  # whole packets ready
        if final and count and len(pending) == count * size:
            count -= 1  # the very last one goes out below, flagged as last
        if count:  # encoded later, together with other streams' packets
            whole = count * size
            out += self._defer_run(pending, count)
            self._pending = _EMPTY if len(pending) == whole else pending[whole:]
        if final:
            out.append(
                self._make(
                    memoryview(encode_samples(self._pending, self.format.encoding)),
                    len(self._pending),
                    last=True,
                )
            )
            self._pending = _EMPTY
            self.finished = True
        return out

    @property
    def duration_ms(self) -> int:
        return round(self.samples_out * 1000 / self.format.sample_rate)

    def _push_pcm(self, pcm: npt.NDArray[np.int16], final: bool) -> list[Packet]:
        """`push` for int16 PCM that is already the payload: whole packets are its bytes sliced,
        with nothing to encode (and nothing deferred)."""
        pcm = np.ascontiguousarray(pcm.reshape(-1))
        if len(self._pending):  # float audio held from before (an engine does not mix them)
            self._pending_pcm, self._pending = to_int16(self._pending), _EMPTY
        pending = np.concatenate((self._pending_pcm, pcm)) if len(self._pending_pcm) else pcm
        size = self._size
        count = len(pending) // size
        if final and count and len(pending) == count * size:
            count -= 1  # the very last one goes out below, flagged as last
        out: list[Packet] = []
        if count:
            whole = count * size
            data = pending[:whole].data.cast("B")
            stream, seq, offset, width = self.stream, self.packets, self.samples_out, 2 * size
            of_frame = Packet.of_frame
            for i in range(count):
                head = _PACK_HEADER(PROTOCOL_VERSION, 0, stream, seq & 0xFFFFFFFF, offset & 0xFFFFFFFF)
                out.append(of_frame(stream, seq, offset, 0, size, head + data[i * width : (i + 1) * width]))
                seq += 1
                offset += size
            self.packets, self.samples_out = seq, offset
            pending = pending[whole:]
        self._pending_pcm = pending if len(pending) else _EMPTY_PCM
        if final:
            rest = self._pending_pcm
            out.append(self._make(rest.tobytes(), len(rest), last=True))
            self._pending_pcm = _EMPTY_PCM
            self.finished = True
        return out

    def _defer_run(self, audio: Audio, count: int) -> list[Packet]:
        """`_defer` of `count` whole packets from the start of `audio`, in one loop (the hot path
        of every chunk longer than one packet)."""
        stream, size, encoding, seq, offset = (
            self.stream,
            self._size,
            self._encoding,
            self.packets,
            self.samples_out,
        )
        run: list[Packet] = []
        new = Packet.__new__
        for i in range(count):  # Packet.deferred, inlined
            packet = new(Packet)
            packet.stream, packet.seq, packet.sample_offset, packet.flags = stream, seq, offset, 0
            packet.samples, packet._frame, packet._encoding = size, None, encoding
            packet._head = _PACK_HEADER(PROTOCOL_VERSION, 0, stream, seq & 0xFFFFFFFF, offset & 0xFFFFFFFF)
            packet._audio = audio[i * size : (i + 1) * size]
            run.append(packet)
            seq += 1
            offset += size
        self.packets, self.samples_out = seq, offset
        _BATCH.add_run(run)
        return run

    def _defer(self, audio: Audio) -> Packet:
        seq, offset = self.packets, self.samples_out
        head = _PACK_HEADER(PROTOCOL_VERSION, 0, self.stream, seq & 0xFFFFFFFF, offset & 0xFFFFFFFF)
        self.packets += 1
        self.samples_out += len(audio)
        return Packet.deferred(self.stream, seq, offset, head, audio, self._encoding)

    def _make(self, payload: bytes | memoryview, samples: int, last: bool) -> Packet:
        seq, offset, flags = self.packets, self.samples_out, FLAG_LAST if last else 0
        header = _PACK_HEADER(PROTOCOL_VERSION, flags, self.stream, seq & 0xFFFFFFFF, offset & 0xFFFFFFFF)
        self.packets += 1
        self.samples_out += samples
        return Packet.of_frame(self.stream, seq, offset, flags, samples, b"".join((header, payload)))
