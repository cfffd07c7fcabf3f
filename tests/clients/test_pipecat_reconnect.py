"""The Pipecat adapter when its WebSocket goes away in the middle of a turn, inside a real Pipecat
pipeline against real gateways (uvicorn on loopback) behind a loopback TCP proxy: a network fault
(the proxy drops the connection) and a server that closes it (a gateway shutting down, another
taking its place). Cadence's session, and the turn's text not yet spoken with it, is gone with the
connection, so the turn ends with an ErrorFrame that names it and its TTSStoppedFrame, never in
silence, and the next turn is spoken on the new connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (  # noqa: E402
    ErrorFrame,
    Frame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from clients.pipecat_adapter import CadenceTTSService  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from tests.fakes import FakeEngine  # noqa: E402
from tests.integration.conftest import RunningGateway, run_gateway  # noqa: E402

pytestmark = pytest.mark.timeout(60)

LONG_TURN = " ".join(f"word{i}" for i in range(40))  # 12 s of audio; made in about 4 s
CUT_AFTER_BYTES = 48_000  # about 1 s of its audio has come through


class CuttableProxy:
    """A TCP proxy on loopback in front of a gateway. `cut()` drops every connection through it at
    once, as a network fault does; new connections go to `upstream_port` as it is then. `flowing`
    is set once `CUT_AFTER_BYTES` have come from the gateway."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.downstream_bytes = 0
        self.flowing = asyncio.Event()
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CuttableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def cut(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [writer, up_writer]
        await asyncio.gather(
            self._pipe(reader, up_writer, False), self._pipe(up_reader, writer, True), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, down: bool) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                if down:
                    self.downstream_bytes += len(data)
                    if self.downstream_bytes >= CUT_AFTER_BYTES:
                        self.flowing.set()
                await writer.drain()
        finally:
            writer.close()


async def speak_through_a_break(
    tts: CadenceTTSService, proxy: CuttableProxy, break_it: Callable[[], Awaitable[None]]
) -> tuple[Sequence[Frame], Sequence[Frame]]:
    """A long turn, the break once about a second of its audio has come, then a second turn."""

    async def when_audio_flows() -> None:
        await proxy.flowing.wait()
        await break_it()

    breaker = asyncio.get_running_loop().create_task(when_audio_flows())
    try:
        return await run_test(
            tts,
            frames_to_send=[
                TTSSpeakFrame(LONG_TURN),
                SleepFrame(2.0),
                TTSSpeakFrame("After the break."),
                SleepFrame(2.0),
            ],
        )
    finally:
        breaker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await breaker


def turns(down: Sequence[Frame]) -> list[str]:
    return list(dict.fromkeys(f.context_id for f in down if isinstance(f, TTSStartedFrame) and f.context_id))


def audio_bytes(down: Sequence[Frame], context_id: str) -> int:
    return sum(len(f.audio) for f in down if isinstance(f, TTSAudioRawFrame) and f.context_id == context_id)


def assert_turn_ended_with_an_error(down: Sequence[Frame], up: Sequence[Frame]) -> None:
    first, second = turns(down)
    assert 0 < audio_bytes(down, first) < 12 * 24_000 * 2  # cut in the middle
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert [e for e in errors if first in e and "connection" in e.lower()], errors
    assert [f for f in down if isinstance(f, TTSStoppedFrame) and f.context_id == first]
    assert audio_bytes(down, second) > 0  # spoken on the new connection


async def test_a_network_fault_ends_the_turn_with_an_error_frame() -> None:
    with run_gateway(FakeEngine(step_s=0.02)) as g:
        async with CuttableProxy(g.port) as proxy:
            tts = CadenceTTSService(url=proxy.url, pacing="asap")

            async def fault() -> None:
                proxy.cut()

            down, up = await speak_through_a_break(tts, proxy, fault)
    assert_turn_ended_with_an_error(down, up)


async def test_a_server_that_closes_the_socket_ends_the_turn_with_an_error_frame() -> None:
    config = GatewayConfig(drain_timeout_s=0.2)
    with run_gateway(FakeEngine(step_s=0.02), config) as first, run_gateway(FakeEngine(), config) as second:
        async with CuttableProxy(first.port) as proxy:
            tts = CadenceTTSService(url=proxy.url, pacing="asap")

            async def shut_down(g: RunningGateway = first) -> None:
                proxy.upstream_port = second.port  # the replacement takes the new connections
                g.stop()  # drains for 0.2 s, then closes the socket with 1001

            down, up = await speak_through_a_break(tts, proxy, shut_down)
    assert_turn_ended_with_an_error(down, up)


async def test_without_automatic_reconnects_the_next_turn_reconnects_and_is_heard() -> None:
    with run_gateway(FakeEngine(step_s=0.02)) as g:
        async with CuttableProxy(g.port) as proxy:
            tts = CadenceTTSService(url=proxy.url, pacing="asap", reconnect_on_error=False)

            async def fault() -> None:
                proxy.cut()

            down, up = await speak_through_a_break(tts, proxy, fault)
    assert_turn_ended_with_an_error(down, up)
