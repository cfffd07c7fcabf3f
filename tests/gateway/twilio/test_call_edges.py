"""Edges of a call's marks: Twilio echoes every mark a `clear` flushed, one network round trip later;
by then the agent may already have unpaused (or spoken again), and the marks sent since carry the
same names (`<utterance_id>/w<index>`, `<utterance_id>/end`). Those late echoes prove nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from engine.espeak.engine import EspeakEngine
from tests.gateway.twilio.conftest import agent_for, twilio_url
from tests.gateway.twilio.simulator import TwilioSimulator
from tests.gateway.twilio.test_twilio import LONG, _speak_and_wait_for_audio
from tests.integration.conftest import RunningGateway, run_gateway

pytestmark = pytest.mark.timeout(60)

ROUND_TRIP_S = 0.6


@pytest.fixture
def espeak_gateway() -> Iterator[RunningGateway]:
    with run_gateway(EspeakEngine()) as running:
        yield running


class SlowEchoSimulator(TwilioSimulator):
    """Twilio across a real network: the echoes of the marks a clear flushed reach the gateway
    a round trip after the clear left it."""

    async def _echo(self, name: str, at: float, after_clear: bool) -> None:
        if not after_clear:
            await super()._echo(name, at, after_clear)
            return

        async def later() -> None:
            await asyncio.sleep(ROUND_TRIP_S)
            await super(SlowEchoSimulator, self)._echo(name, at, after_clear)

        self._tasks.append(self._loop.create_task(later()))


async def test_a_quick_unpause_is_not_fooled_by_the_late_echoes_of_the_clear(
    espeak_gateway: RunningGateway,
) -> None:
    sid = "CA-quick-unpause"
    async with SlowEchoSimulator(twilio_url(espeak_gateway), call_sid=sid) as sim:
        async with agent_for(espeak_gateway, sid) as agent:
            await _speak_and_wait_for_audio(agent, sim, LONG, after_s=1.0)
            await agent.send(type="speak.pause", utterance_id="u1")
            paused = await agent.until("utterance.paused", utterance_id="u1")
            await agent.send(type="speak.unpause", utterance_id="u1")
            await agent.until("utterance.unpaused", utterance_id="u1")
            await asyncio.sleep(ROUND_TRIP_S + 0.4)  # the flushed marks' echoes are back
            # the caller heard about a second more of it, far from its end: the flushed marks'
            # echoes must not count as heard, nor end it
            assert not agent.of_type("utterance.played")
            await agent.send(type="speak.pause", utterance_id="u1")
            for _ in range(500):
                if len(agent.of_type("utterance.paused")) == 2:
                    break
                await asyncio.sleep(0.01)
            again = agent.of_type("utterance.paused")[1]
            assert len(sim.log.clears) == 2
            second_clear = sim.log.clears[1]
            await agent.send(type="speak.cancel", utterance_id="u1")
            await agent.until("utterance.interrupted", utterance_id="u1")
    heard_before = [
        e.name
        for e in sim.log.echoes
        if not e.after_clear and e.at < second_clear and e.name.startswith("u1/w")
    ]
    last = again["last_word"]
    assert last is not None and paused["last_word"] is not None
    assert last["index"] <= max(int(n.split("/w")[1]) for n in heard_before)
