"""The fan-out bench's lean client: its frames are valid WebSocket client frames, and against the
real gateway it sees every packet of a real-time stream with a small, non-negative lag; from an
engine ahead of real time, paced by the gateway, every packet comes before its playout time."""

from __future__ import annotations

import argparse

import pytest
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from bench.fanout import client_frame, lags_of, median_level, passes, raw_stream
from engine.null import NullEngine
from tests.integration.conftest import GatewayFactory

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536])
def test_client_frames_parse_as_masked_websocket_frames(size: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    reader = StreamReader()
    reader.feed_data(client_frame(Opcode.TEXT.value, payload))
    parser = Frame.parse(reader.read_exact, mask=True, max_size=None, extensions=[])
    try:
        next(parser)
        raise AssertionError("the frame was not complete")
    except StopIteration as done:
        frame = done.value
    assert frame.opcode is Opcode.TEXT and frame.fin and bytes(frame.data) == payload


def test_lags_count_from_the_streams_earliest_packet() -> None:
    times = [10.0, 10.02, 10.045, 10.06]
    offsets = [0, 480, 960, 1440]
    lags = lags_of(times, offsets, 24_000, skip_samples=480)
    assert [round(x * 1000, 3) for x in lags] == [0.0, 5.0, 0.0]


def test_playout_lags_count_from_the_first_packets_arrival() -> None:
    # a stream sent ahead: 60 ms of audio at once, then a packet 25 ms past its playout time
    times = [10.0, 10.0, 10.0, 10.085]
    offsets = [0, 480, 960, 1440]
    lags = lags_of(times, offsets, 24_000, skip_samples=0, lag="playout")
    assert [round(x * 1000, 3) for x in lags] == [0.0, -20.0, -40.0, 25.0]


async def test_the_raw_client_sees_a_whole_realtime_stream(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(NullEngine())
    lags, first_audio, error = await raw_stream(
        gateway.ws, "Hello there, my friend.", 0.0, 0, "realtime", "jitter"
    )
    assert error is None
    assert len(lags) > 50  # ~1.6 s of audio in 20 ms packets
    assert min(lags) == 0.0 and max(lags) < 0.5
    assert first_audio is not None and 0.0 < first_audio < 0.5


async def test_an_engine_ahead_of_real_time_is_paced_by_the_gateway(gateway_factory: GatewayFactory) -> None:
    """At four times real time the engine is done long before the stream is: the gateway sends the
    lead at once and the rest on its clock, so no packet comes past its playout time, and the
    stream takes its real duration."""
    gateway = gateway_factory(NullEngine(chunk_ms=80, speed=4.0))
    lags, first_audio, error = await raw_stream(
        gateway.ws, "Hello there, my friend.", 0.0, 0, "realtime", "playout"
    )
    assert error is None and len(lags) > 50
    assert min(lags) < -0.2  # the realtime lead (300 ms by default): sent ahead of its playout
    assert max(lags) <= 0.01


def test_a_level_passes_on_the_median_of_its_runs() -> None:
    """Lag and first audio are each the median of the runs: a level whose median-lag run started
    its streams promptly still fails when most runs did not."""
    runs = [
        {"lag_p99_ms": lag, "first_audio_p99_ms": first, "gateway_cpu_pct": 50.0, "errors": 0}
        for lag, first in ((5.0, 400.0), (6.0, 60.0), (7.0, 300.0))
    ]
    level = median_level(runs)
    assert level["lag_p99_ms"] == 6.0 and level["first_audio_p99_ms"] == 300.0
    limits = argparse.Namespace(limit_ms=10.0, first_audio_limit_ms=100.0)
    assert not passes(level, limits)
    assert passes(median_level([dict(r, first_audio_p99_ms=60.0) for r in runs]), limits)
