"""A push encodes the packets it makes in one call and hands them over whole: each carries exactly
the bytes that encoding its own samples alone would, for every encoding and any way the engine's
audio is chunked, and nothing is encoded when a packet is read."""

from __future__ import annotations

import numpy as np
import pytest

from gateway import packets as packets_module
from gateway.packets import (
    OutputFormat,
    Packetiser,
    alaw_encode,
    encode_samples,
    mulaw_encode,
    to_int16,
)


@pytest.mark.parametrize("encoding", ["pcm_s16le", "pcm_f32le", "mulaw", "alaw"])
@pytest.mark.parametrize("chunks", [[4800], [480, 480, 960, 2880], [1, 479, 7000, 13], [2400, 2400]])
def test_packets_of_a_chunk_equal_packet_by_packet_encoding(encoding: str, chunks: list[int]) -> None:
    rate = 8000 if encoding in ("mulaw", "alaw") else 24000
    rng = np.random.default_rng(len(chunks))
    audio = (rng.standard_normal(sum(chunks)) * 0.6).astype(np.float32)  # some samples beyond +-1
    packetiser = Packetiser(3, OutputFormat(encoding, rate, 20), rate)
    packets, start = [], 0
    for i, n in enumerate(chunks):
        packets += packetiser.push(audio[start : start + n], final=i == len(chunks) - 1)
        start += n
    size = rate // 50
    assert [p.header.seq for p in packets] == list(range(len(packets)))
    assert [p.header.sample_offset for p in packets] == [i * size for i in range(len(packets))]
    assert packets[-1].last and not any(p.last for p in packets[:-1])
    for p in packets:
        expected = encode_samples(
            audio[p.header.sample_offset : p.header.sample_offset + p.samples], encoding
        )
        assert p.payload == expected


@pytest.mark.parametrize("encoding", ["pcm_s16le", "pcm_f32le", "mulaw", "alaw"])
def test_a_push_encodes_once_and_its_packets_hold_their_bytes(
    encoding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rate = 8000 if encoding in ("mulaw", "alaw") else 24000
    audio = (np.random.default_rng(5).standard_normal(rate // 10) * 0.5).astype(np.float32)  # 100 ms
    calls: list[int] = []
    real = packets_module.encode_samples

    def counting(samples: np.ndarray, encoding: str) -> bytes:
        calls.append(len(samples))
        return real(samples, encoding)  # type: ignore[arg-type]

    monkeypatch.setattr(packets_module, "encode_samples", counting)
    packets = Packetiser(1, OutputFormat(encoding, rate, 20), rate).push(audio)  # type: ignore[arg-type]
    assert len(packets) == 5 and calls == [len(audio)]

    def refuse(samples: np.ndarray, encoding: str) -> bytes:
        raise AssertionError("encoded on read")

    monkeypatch.setattr(packets_module, "encode_samples", refuse)
    step = rate // 50
    for i, p in enumerate(packets):
        assert p.payload == real(audio[i * step : (i + 1) * step], encoding)  # type: ignore[arg-type]


def test_g711_codes_are_the_encoders_codes_for_every_sample_value() -> None:
    """The packetiser looks G.711 codes up in tables: they are the encoders' codes, value by value
    (every int16 value, and audio past full scale)."""
    every = np.concatenate((np.arange(-32768, 32768) / 32767.0, [-1.5, 1.5, 7.0]), dtype=np.float32)
    pcm = to_int16(every)
    assert len(np.unique(pcm)) == 65535
    assert encode_samples(every, "mulaw") == mulaw_encode(pcm).tobytes()
    assert encode_samples(every, "alaw") == alaw_encode(pcm).tobytes()


def test_int16_packets_are_copies_of_the_engine_audio() -> None:
    """The default payload is the engine's PCM sliced: the packets keep their bytes when the engine
    reuses its buffer."""
    pcm = np.arange(960, dtype=np.int16)
    packets = Packetiser(1, OutputFormat(), 24000).push(pcm)
    want = [p.payload for p in packets]
    pcm[:] = 0
    assert [p.payload for p in packets] == want and want[0] == np.arange(480, dtype=np.int16).tobytes()
