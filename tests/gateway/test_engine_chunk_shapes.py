"""Engine chunks whose samples come as a column (n, 1) or a row (1, n): int16 PCM is timed, trimmed
and packetised exactly like float32, so the sample timeline counts samples, not array rows."""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import AudioChunk
from gateway.packets import Packet
from tests.gateway.test_protocol import Harness

N = 480  # one 20 ms packet at 24 kHz


def _samples(dtype: str, shape: str, n: int = N) -> np.ndarray:
    flat = np.full(n, 8192, np.int16) if dtype == "int16" else np.full(n, 0.25, np.float32)
    return {"flat": flat, "column": flat.reshape(n, 1), "row": flat.reshape(1, n)}[shape]


def _packets(h: Harness) -> list[Packet]:
    return [x for _, x in h.audio if isinstance(x, Packet)]


SHAPES = pytest.mark.parametrize("shape", ["flat", "column", "row"])
DTYPES = pytest.mark.parametrize("dtype", ["int16", "float32"])


@SHAPES
@DTYPES
def test_back_to_back_chunks_leave_no_gap(dtype: str, shape: str) -> None:
    h = Harness()
    h.say("u1", "x")
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", _samples(dtype, shape), 0)))
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", _samples(dtype, shape), N, final=True)))
    assert h.p.utterance("u1").engine_samples == 2 * N  # type: ignore[union-attr]
    packets = _packets(h)
    assert [p.header.sample_offset for p in packets] == [0, N]
    assert sum(p.samples for p in packets) == 2 * N
    # every sample is the engine's audio: no silence stands in for a gap that never was
    for p in packets:
        assert np.frombuffer(p.payload, "<i2").all()
    trailer = h.audio[-1][1]
    assert isinstance(trailer, dict) and trailer["duration_ms"] == 40


@SHAPES
@DTYPES
def test_an_overlapping_chunk_is_trimmed_by_samples(dtype: str, shape: str) -> None:
    h = Harness()
    h.say("u1", "x")
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", _samples(dtype, shape), 0)))
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", _samples(dtype, shape), N // 2, final=True)))
    assert h.p.utterance("u1").engine_samples == N + N // 2  # type: ignore[union-attr]
    assert sum(p.samples for p in _packets(h)) == N + N // 2


@SHAPES
@DTYPES
def test_a_real_gap_is_filled_with_silence_of_its_length(dtype: str, shape: str) -> None:
    h = Harness()
    h.say("u1", "x")
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", _samples(dtype, shape), 0)))
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", _samples(dtype, shape), 2 * N, final=True)))
    packets = _packets(h)
    assert [p.header.sample_offset for p in packets] == [0, N, 2 * N]
    assert not np.frombuffer(packets[1].payload, "<i2").any()
    assert np.frombuffer(packets[2].payload, "<i2").all()


@SHAPES
def test_int16_and_float_chunks_give_the_same_packets(shape: str) -> None:
    def run(dtype: str) -> list[tuple[int, int, bytes]]:
        h = Harness()
        h.say("u1", "x")
        for i, offset in enumerate((0, N, N + N // 2)):  # back to back, then an overlap
            chunk = AudioChunk("u1", _samples(dtype, shape), offset, final=i == 2)
            h.run(h.p.receive_chunk("u1", chunk))
        return [(p.header.sample_offset, p.samples, p.payload) for p in _packets(h)]

    assert run("int16") == run("float32")
