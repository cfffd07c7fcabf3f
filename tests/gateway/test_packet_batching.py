"""Packets cut from a whole chunk encoded at once carry exactly the bytes that encoding each packet
alone would, for every encoding and any way the engine's audio is chunked; packets that several
streams make in one pass are encoded together, at the first read, with the same bytes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gateway import packets as packets_module
from gateway.messages import PacketHeader
from gateway.packets import OutputFormat, Packet, Packetiser, encode_samples


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
        expected = encode_samples(
            audio[p.header.sample_offset : p.header.sample_offset + p.samples], encoding
        )
        assert p.payload == expected


def _chunks_of_several_streams(rounds: int) -> tuple[list[Packet], dict[int, np.ndarray]]:
    """Four streams (every encoding), each given one 20 ms chunk per round, interleaved as an event
    loop pass would make them; the packets and each stream's audio."""
    rng = np.random.default_rng(7)
    formats = {1: ("pcm_s16le", 24000), 2: ("pcm_f32le", 24000), 3: ("mulaw", 8000), 4: ("alaw", 8000)}
    packetisers = {s: Packetiser(s, OutputFormat(enc, rate, 20), rate) for s, (enc, rate) in formats.items()}
    audio = {
        s: (rng.standard_normal(rounds * rate // 50) * 0.6).astype(np.float32)
        for s, (_, rate) in formats.items()
    }
    packets: list[Packet] = []
    for r in range(rounds):
        for s, (_, rate) in formats.items():
            size = rate // 50
            packets += packetisers[s].push(audio[s][r * size : (r + 1) * size])
    return packets, audio


def _expected_frame(packet: Packet, audio: np.ndarray, encoding: str) -> bytes:
    header = PacketHeader(packet.stream, packet.seq, packet.sample_offset, packet.flags)
    return header.pack() + encode_samples(
        audio[packet.sample_offset : packet.sample_offset + packet.samples], encoding
    )


ENCODING_OF_STREAM = {1: "pcm_s16le", 2: "pcm_f32le", 3: "mulaw", 4: "alaw"}


def test_packets_of_many_streams_are_encoded_in_one_pass_per_encoding_when_first_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packets_module._BATCH.flush()  # packets other tests left unread
    calls: list[int] = []
    real = packets_module.encode_samples

    def counting(samples: np.ndarray, encoding: str) -> bytes:
        calls.append(len(samples))
        return real(samples, encoding)

    real_s16le = packets_module._EncodeBatch._s16le

    def counting_s16le(batch: packets_module._EncodeBatch, audio: list[np.ndarray]) -> memoryview:
        calls.append(sum(len(a) for a in audio))
        return real_s16le(batch, audio)

    monkeypatch.setattr(packets_module, "encode_samples", counting)
    monkeypatch.setattr(packets_module._EncodeBatch, "_s16le", counting_s16le)  # pcm_s16le: kept buffers
    packets, audio = _chunks_of_several_streams(rounds=3)
    assert len(packets) == 12 and not calls  # nothing encoded while the packets are made
    last_read = packets[-1].frame  # the first read encodes them all: one call per encoding
    assert sorted(calls) == sorted([3 * 160, 3 * 160, 3 * 480, 3 * 480])
    for p in reversed(packets):  # any order: exact bytes, each packet its own samples
        assert p.frame == _expected_frame(p, audio[p.stream], ENCODING_OF_STREAM[p.stream])
    assert last_read == packets[-1].frame and len(calls) == 4  # read again: no new encoding


def test_a_packet_read_in_another_thread_gets_the_same_bytes() -> None:
    packets, audio = _chunks_of_several_streams(rounds=2)
    frames: list[bytes] = []
    reader = threading.Thread(target=lambda: frames.extend(p.frame for p in packets))
    reader.start()
    reader.join()
    assert frames == [_expected_frame(p, audio[p.stream], ENCODING_OF_STREAM[p.stream]) for p in packets]


def test_packets_never_read_do_not_pile_up() -> None:
    limit = packets_module._EncodeBatch.limit
    packetiser = Packetiser(9, OutputFormat(), 24000)
    tone = np.full(480, 0.25, np.float32)
    made = [packetiser.push(tone)[0] for _ in range(limit + 10)]  # e.g. purged by a fence, never read
    assert len(packets_module._BATCH.pending) <= limit
    assert made[0].frame == _expected_frame(made[0], np.tile(tone, limit + 10), "pcm_s16le")
    assert made[-1].frame == _expected_frame(made[-1], np.tile(tone, limit + 10), "pcm_s16le")


def test_pcm_s16le_passes_reuse_their_buffers_and_frames_stay_their_own() -> None:
    packets_module._BATCH.flush()
    rng = np.random.default_rng(3)
    packetiser = Packetiser(5, OutputFormat(), 24000)
    audio = (rng.standard_normal(480 * 60) * 0.8).astype(np.float32)
    audio[:4] = [1.5, -1.5, 0.999, -0.999]  # clipped, and near the edges
    first = [packetiser.push(audio[i * 480 : (i + 1) * 480])[0] for i in range(40)]
    first_frames = [p.frame for p in first]  # one pass of 40 packets
    buffer = packets_module._BATCH._int16
    second = [packetiser.push(audio[i * 480 : (i + 1) * 480])[0] for i in range(40, 60)]
    second_frames = [p.frame for p in second]  # a smaller pass: the same buffers, overwritten
    assert packets_module._BATCH._int16 is buffer
    for packet, frame in zip(first + second, first_frames + second_frames, strict=True):
        assert frame == packet.frame == _expected_frame(packet, audio, "pcm_s16le")
