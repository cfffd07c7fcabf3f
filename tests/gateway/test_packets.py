"""Packetiser, streaming resampler and encoders."""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import float_samples, pcm16
from gateway.messages import ProtocolError
from gateway.packets import (
    OutputFormat,
    Packetiser,
    StreamResampler,
    alaw_decode,
    alaw_encode,
    decode_payload,
    encode_samples,
    mulaw_decode,
    mulaw_encode,
)


def sine(n: int, rate: int, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    return (amp * np.sin(2 * np.pi * freq * np.arange(n) / rate)).astype(np.float32)


def push_in_chunks(p: Packetiser, audio: np.ndarray, sizes: list[int]) -> list:
    out, i, k = [], 0, 0
    while i < len(audio):
        n = sizes[k % len(sizes)]
        out += p.push(audio[i : i + n])
        i, k = i + n, k + 1
    return out + p.push(np.zeros(0, np.float32), final=True)


def test_default_format_is_480_samples_960_bytes() -> None:
    fmt = OutputFormat()
    assert fmt.samples_per_packet == 480
    p = Packetiser(7, fmt, 24000)
    packets = p.push(sine(1000, 24000), final=True)
    assert [len(pk.payload) for pk in packets] == [960, 960, 80]
    assert [pk.header.seq for pk in packets] == [0, 1, 2]
    assert [pk.header.sample_offset for pk in packets] == [0, 480, 960]
    assert [pk.last for pk in packets] == [False, False, True]
    assert all(pk.header.stream == 7 for pk in packets)
    assert p.packets == 3 and p.samples_out == 1000


def test_packets_do_not_depend_on_chunking() -> None:
    audio = sine(24000, 24000)
    one = Packetiser(1, OutputFormat(), 24000)
    whole = one.push(audio) + one.push(np.zeros(0, np.float32), final=True)
    chunked = push_in_chunks(Packetiser(1, OutputFormat(), 24000), audio, [7, 333, 1000, 1])
    assert [p.frame for p in whole] == [p.frame for p in chunked]


def test_audio_ending_on_a_packet_edge_gets_an_empty_last_packet() -> None:
    p = Packetiser(1, OutputFormat(), 24000)
    packets = p.push(sine(960, 24000))
    assert len(packets) == 2 and not packets[-1].last
    final = p.push(np.zeros(0, np.float32), final=True)
    assert len(final) == 1 and final[0].last and final[0].payload == b"" and final[0].header.seq == 2


def test_final_with_audio_exactly_one_packet_marks_it_last() -> None:
    packets = Packetiser(1, OutputFormat(), 24000).push(sine(480, 24000), final=True)
    assert len(packets) == 1 and packets[0].last and len(packets[0].payload) == 960


def test_push_after_last_packet_fails() -> None:
    p = Packetiser(1, OutputFormat(), 24000)
    p.push(sine(10, 24000), final=True)
    with pytest.raises(RuntimeError):
        p.push(sine(10, 24000))


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_resampled_duration_and_continuity(rate: int) -> None:
    audio = sine(24000, 24000, freq=300)
    fmt = OutputFormat("pcm_f32le", rate, 20)
    packets = push_in_chunks(Packetiser(1, fmt, 24000), audio, [960, 37, 2400])
    out = np.concatenate([decode_payload(p.payload, "pcm_f32le") for p in packets])
    assert abs(len(out) - rate) <= 2  # one second in, one second out
    offsets = [p.header.sample_offset for p in packets]
    assert offsets == [i * fmt.samples_per_packet for i in range(len(packets))]
    # no clicks: the biggest sample step stays near that of a 300 Hz sine at this rate
    middle = out[rate // 10 : -rate // 10]
    assert np.max(np.abs(np.diff(middle))) < 0.5 * 2 * np.pi * 300 / rate * 1.2
    reference = StreamResampler(24000, rate).process(audio, last=True)
    assert np.allclose(out[: len(reference)], reference, atol=1e-4)


def test_streaming_resampler_matches_one_shot() -> None:
    audio = sine(4800, 24000)
    r = StreamResampler(24000, 16000)
    pieces = [r.process(audio[i : i + 100]) for i in range(0, 4800, 100)] + [r.process(audio[:0], last=True)]
    assert np.allclose(
        np.concatenate(pieces), StreamResampler(24000, 16000).process(audio, last=True), atol=1e-5
    )


def test_identity_resampler_passes_through() -> None:
    audio = sine(100, 24000)
    assert np.array_equal(StreamResampler(24000, 24000).process(audio), audio)


def test_s16le_and_f32le_encode() -> None:
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0], np.float32)
    assert np.frombuffer(encode_samples(x, "pcm_s16le"), "<i2").tolist() == [
        0,
        16384,
        -16384,
        32767,
        -32767,
        32767,
    ]
    assert np.frombuffer(encode_samples(x, "pcm_f32le"), "<f4").tolist() == [0.0, 0.5, -0.5, 1.0, -1.0, 1.0]


@pytest.mark.parametrize(("encode", "decode"), [(mulaw_encode, mulaw_decode), (alaw_encode, alaw_decode)])
def test_g711_round_trip_error_is_small(encode, decode) -> None:  # type: ignore[no-untyped-def]
    pcm = np.arange(-32768, 32768, 7, dtype=np.int16)
    back = decode(encode(pcm)).astype(np.int32)
    error = np.abs(back - pcm.astype(np.int32))
    assert np.all(error <= np.maximum(np.abs(pcm.astype(np.int32)) * 0.07, 40))


def test_g711_known_codes() -> None:
    silence = np.zeros(1, np.int16)
    assert mulaw_encode(silence)[0] == 0xFF and alaw_encode(silence)[0] == 0xD5
    full = np.array([32767, -32768], np.int16)
    assert mulaw_encode(full).tolist() == [0x80, 0x00]
    assert alaw_encode(full).tolist() == [0xAA, 0x2A]


def test_mulaw_packets_are_8k_one_byte_per_sample() -> None:
    fmt = OutputFormat("mulaw", 8000, 20)
    packets = Packetiser(3, fmt, 24000).push(sine(24000, 24000), final=True)
    assert all(len(p.payload) == 160 for p in packets[:-1])
    audio = np.concatenate([decode_payload(p.payload, "mulaw") for p in packets])
    assert 0.4 < np.max(np.abs(audio)) < 0.6


@pytest.mark.parametrize(("encoding", "rate"), [("mulaw", 16000), ("alaw", 24000), ("pcm_s16le", 11025)])
def test_invalid_formats_are_refused(encoding: str, rate: int) -> None:
    with pytest.raises(ProtocolError):
        OutputFormat(encoding, rate, 20)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fmt", [OutputFormat(), OutputFormat("mulaw", 8000, 20), OutputFormat("pcm_f32le", 48000, 40)]
)
def test_int16_engine_audio_makes_the_packets_its_float_form_makes(fmt: OutputFormat) -> None:
    """Engines in another process hand over int16 PCM: it is the default payload as it is, and
    any other output is made from its float form, so the packets equal those of the float audio
    it stands for, cut the same way, last packet included."""
    audio = pcm16(sine(480 * 7 + 123, 24_000, amp=0.9))
    cuts = [0, 300, 1920, 2000, len(audio)]
    from_pcm, from_float = Packetiser(1, fmt, 24_000), Packetiser(1, fmt, 24_000)
    got: list = []
    want: list = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        final = b == len(audio)
        got += from_pcm.push(audio[a:b], final=final)
        want += from_float.push(float_samples(audio[a:b]), final=final)
    assert [p.frame for p in got] == [p.frame for p in want]
    assert got[-1].last and not any(p.last for p in got[:-1])
    if fmt == OutputFormat():  # the payload is the engine's PCM itself
        assert b"".join(p.payload for p in got) == audio.tobytes()


@pytest.mark.parametrize("pcm_first", [True, False])
def test_a_stream_mixing_float_and_int16_audio_stays_whole(pcm_first: bool) -> None:
    p = Packetiser(1, OutputFormat(), 24_000)
    a, b = sine(700, 24_000), sine(500, 24_000, freq=300.0)
    first, second = (pcm16(a), b) if pcm_first else (a, pcm16(b))
    packets = p.push(first) + p.push(second, final=True)
    payload = b"".join(pk.payload for pk in packets)
    assert payload == pcm16(a).tobytes() + pcm16(b).tobytes()
    assert [pk.seq for pk in packets] == list(range(len(packets))) and packets[-1].last


def test_pcm16_and_float_samples_round_trip() -> None:
    x = np.array([-1.5, -1.0, -0.5, 0.0, 1e-6, 0.5, 0.99999, 1.0, 2.0], np.float32)
    pcm = pcm16(x)
    assert pcm.dtype == np.int16 and list(pcm[[0, 1, 3, 7, 8]]) == [-32767, -32767, 0, 32767, 32767]
    assert np.array_equal(pcm16(float_samples(pcm)), pcm)
    assert float_samples(x) is x  # float32 mono passes through
