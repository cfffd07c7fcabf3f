"""The Pipecat adapter when a turn's text comes while its receive loop is still making the lost
connection again, inside a real Pipecat pipeline against a real gateway (uvicorn on loopback)
behind a loopback TCP proxy. The turn's text makes a connection of its own then; the reconnect
that follows keeps that connection (the turn's audio is on it) rather than closing it and the
turn's audio context, so the turn is heard and ends with its TTSStoppedFrame, not in silence."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import TTSSpeakFrame, TTSStoppedFrame  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from clients.pipecat_adapter import CadenceTTSService  # noqa: E402
from tests.clients.test_pipecat_reconnect import LONG_TURN, CuttableProxy, audio_bytes, turns  # noqa: E402
from tests.fakes import FakeEngine  # noqa: E402
from tests.integration.conftest import run_gateway  # noqa: E402

pytestmark = pytest.mark.timeout(60)

BACKOFF_S = 3.0  # between the receive loop's reconnect attempts


class FlakyProxy(CuttableProxy):
    """A CuttableProxy that, while `down`, closes each new connection at once (a gateway that is
    not there yet)."""

    down = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        await super()._serve(reader, writer)


async def test_a_turn_that_reconnects_while_the_receive_loop_waits_to_is_heard() -> None:
    with run_gateway(FakeEngine(step_s=0.02)) as g:
        async with FlakyProxy(g.port) as proxy:
            tts = CadenceTTSService(url=proxy.url, pacing="asap")
            tts._reconnect_backoff_min_wait = tts._reconnect_backoff_max_wait = BACKOFF_S

            async def fault_then_recovery() -> None:
                await proxy.flowing.wait()
                proxy.down = True  # the receive loop's first attempt fails: it waits BACKOFF_S
                proxy.cut()
                await asyncio.sleep(0.5)
                proxy.down = False  # the next turn's text connects again before that attempt

            breaker = asyncio.get_running_loop().create_task(fault_then_recovery())
            try:
                down, _ = await run_test(
                    tts,
                    frames_to_send=[
                        TTSSpeakFrame(LONG_TURN),
                        SleepFrame(1.5),  # the cut, the failed attempt and the recovery
                        TTSSpeakFrame("After the break."),
                        SleepFrame(BACKOFF_S + 1.5),  # the receive loop's second attempt comes
                    ],
                )
            finally:
                breaker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await breaker
    first, second = turns(down)
    assert [f for f in down if isinstance(f, TTSStoppedFrame) and f.context_id == first]
    assert audio_bytes(down, second) > 0  # spoken on the connection its text made
    assert [f for f in down if isinstance(f, TTSStoppedFrame) and f.context_id == second]


class SlowProxy(CuttableProxy):
    """A CuttableProxy that, while `slow`, takes half a second to reach the gateway for each new
    connection (a reconnect over a slow network)."""

    slow = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.slow:
            await asyncio.sleep(0.5)
        await super()._serve(reader, writer)


async def test_a_turn_while_the_receive_loop_reconnects_leaves_one_connection() -> None:
    """The turn's text waits for the connection the receive loop is making, rather than making a
    second one that nothing closes: once the pipeline ends, the gateway holds no session."""
    with run_gateway(FakeEngine(step_s=0.02)) as g:
        async with SlowProxy(g.port) as proxy:
            tts = CadenceTTSService(url=proxy.url, pacing="asap")

            async def fault() -> None:
                await proxy.flowing.wait()
                proxy.slow = True
                proxy.cut()

            breaker = asyncio.get_running_loop().create_task(fault())
            try:
                down, _ = await run_test(
                    tts,
                    frames_to_send=[
                        TTSSpeakFrame(LONG_TURN),
                        SleepFrame(0.6),  # the cut comes at about 0.35 s; its reconnect takes 0.5 s
                        TTSSpeakFrame("After the break."),
                        SleepFrame(2.0),
                    ],
                )
            finally:
                breaker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await breaker
            sessions = g.server.gateway.sessions
            for _ in range(100):
                if not sessions:
                    break
                await asyncio.sleep(0.05)
            assert not sessions, f"{len(sessions)} Cadence session(s) left open"
    first, second = turns(down)
    assert audio_bytes(down, second) > 0
