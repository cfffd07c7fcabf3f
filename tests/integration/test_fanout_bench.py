"""The fan-out bench's lean client: its frames are valid WebSocket client frames, and against the
real gateway it sees every packet of a real-time stream with a small, non-negative lag."""

from __future__ import annotations

import pytest
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from engine.null import NullEngine
from scripts.bench_fanout import client_frame, lags_of, raw_stream
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


async def test_the_raw_client_sees_a_whole_realtime_stream(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(NullEngine())
    lags, error = await raw_stream(gateway.ws, "Hello there, my friend.", 0.0, 0, "realtime")
    assert error is None
    assert len(lags) > 50  # ~1.6 s of audio in 20 ms packets
    assert min(lags) == 0.0 and max(lags) < 0.5
