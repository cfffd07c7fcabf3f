"""Packets cut from a whole chunk encoded at once carry exactly the bytes that encoding each packet
alone would, for every encoding and any way the engine's audio is chunked."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.packets import OutputFormat, Packetiser, encode_samples


@pytest.mark.parametrize("encoding", ["pcm_s16le", "pcm_f32le", "mulaw", "alaw"])
@pytest.mark.parametrize("chunks", [[4800], [480, 480, 960, 2880], [1, 479, 7000, 13], [2400, 2400]])
def test_batched_packets_equal_packet_by_packet_encoding(encoding: str, chunks: list[int]) -> None:
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
        expected = encode_samples(audio[p.header.sample_offset : p.header.sample_offset + p.samples], encoding)
        assert p.payload == expected
