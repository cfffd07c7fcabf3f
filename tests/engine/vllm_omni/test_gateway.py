"""The real gateway over loopback, its engine the vllm-omni backend, its upstream the simulator."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cadence.engines import EngineOptions, build_engine
from engine.vllm_omni.engine import VllmOmniEngine
from tests.engine.vllm_omni.conftest import engine_for
from tests.engine.vllm_omni.simulator import RunningSimulator, sentence_samples
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(30)

TEXT = "Hello from vLLM-Omni. The gateway speaks for it."


async def wait_status(url: str, status: int, limit_s: float = 5.0) -> dict[str, object]:
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient() as client:
        while True:
            response = await client.get(url)
            if response.status_code == status:
                return response.json()  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                raise AssertionError(f"{url} stayed {response.status_code}: {response.text}")
            await asyncio.sleep(0.05)


async def test_speak_through_the_gateway_and_readyz_follows_the_upstream(sim: RunningSimulator) -> None:
    engine = engine_for(sim, max_streams=1)
    with run_gateway(engine) as gateway:
        body = await wait_status(f"{gateway.http}/readyz", 200)
        assert body["engine"] == "vllm-omni" and body["capacity"] == 1
        async with connect(gateway.ws) as ws:
            client = Client(ws)
            await client.send(type="speak.append", utterance_id="u1", text=TEXT)
            await client.send(type="speak.end", utterance_id="u1")
            await client.until("utterance.done", "u1")
        packets = client.got.packets_of(client.got.stream_of("u1"))
        samples = sum(len(payload) // 2 for _, payload in packets)
        upstream = sum(sentence_samples(t, sim.options.ms_per_char) for t in sim.stats.texts)
        assert sim.stats.texts and " ".join(sim.stats.texts) == TEXT
        assert abs(samples - upstream) < 480  # the gateway's 20 ms packets carry the upstream audio
        words = client.got.words_of("u1")
        assert [w["text"] for w in words] == TEXT.split()
        assert all(TEXT[w["char_start"] : w["char_end"]] == w["text"] for w in words)

        sim.options.max_num_seqs = 0  # the next request crashes the upstream
        async with connect(gateway.ws) as ws:
            client = Client(ws)
            await client.send(type="speak.append", utterance_id="u2", text="This one crashes it.")
            await client.send(type="speak.end", utterance_id="u2")
            await client.until("error", wait_s=10)
        body = await wait_status(f"{gateway.http}/readyz", 503)
        assert body["ready"] is False
        sim.options.max_num_seqs = 64
        sim.simulator.restart()
        await wait_status(f"{gateway.http}/readyz", 200)


def test_cli_factory_builds_the_backend() -> None:
    engine = build_engine(
        EngineOptions(name="vllm-omni", upstream="http://upstream:8091", max_streams=40, upstream_streams=6)
    )
    assert isinstance(engine, VllmOmniEngine)
    assert engine.config.max_streams == 6 and engine.config.queue_limit == 34
    with pytest.raises(SystemExit, match="--upstream"):
        build_engine(EngineOptions(name="vllm-omni"))
