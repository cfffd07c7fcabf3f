"""Fault injection over real sockets: 10 000 generated frames on one session, disconnects at every
protocol state, an engine failure among healthy utterances, SIGTERM mid-utterance."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed

from tests.fakes import FakeEngine
from tests.gateway.test_protocol_fuzz import HOSTILE, garbage
from tests.integration.conftest import GatewayFactory, RunningGateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(120)


async def test_10k_generated_frames_over_a_real_socket(gateway: RunningGateway) -> None:
    rng = random.Random(11)
    frames: list[tuple[str | bytes, str | None]] = []
    while len(frames) < 10_000:
        roll = rng.random()
        if roll < 0.5:
            frame, code = rng.choice(HOSTILE)
            if frame.encode("utf-8", "surrogatepass") == frame.encode("utf-8", "replace"):  # sendable as text
                frames.append((frame, code))
        elif roll < 0.6:
            text = garbage(rng)
            try:
                json.loads(text)
                continue
            except ValueError:
                frames.append((text, "invalid_message"))
        elif roll < 0.65:
            frames.append((rng.randbytes(rng.randint(1, 100)), "binary_not_supported"))
        else:  # valid, answered by nothing
            frames.append(
                (
                    json.dumps(
                        {"type": "playback.report", "utterance_id": "u0", "played_ms": rng.randint(0, 9999)}
                    ),
                    None,
                )
            )
    expected = [code for _, code in frames if code is not None]
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u0", text="warm up", flush=True)
        await c.send(type="speak.end", utterance_id="u0")
        await c.until("utterance.done", "u0")

        async def sender() -> None:
            for frame, _ in frames:
                await ws.send(frame)

        async def receiver() -> list[str]:
            codes: list[str] = []
            while len(codes) < len(expected):
                message = await c.next(20)
                if isinstance(message, dict):
                    assert message["type"] == "error", message
                    codes.append(message["code"])
            return codes

        _, codes = await asyncio.gather(sender(), receiver())
        assert codes == expected
        await c.send(type="speak.append", utterance_id="u1", text="still here", flush=True)
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
    assert len(frames) >= 10_000


STATES = ["connected", "started", "opened", "mid_audio", "text_closed", "interrupted", "two_open", "ending"]


async def _drive_to(c: Client, state: str) -> None:
    if state == "connected":
        return
    await c.send(type="session.start")
    await c.until("session.started")
    if state == "started":
        return
    await c.send(
        type="speak.append", utterance_id="u1", text="one two three four five six seven eight nine " * 5
    )
    await c.until("utterance.started", "u1")
    if state == "opened":
        return
    await c.send(type="speak.flush", utterance_id="u1")
    while not c.got.packets:
        await c.next()
    if state == "mid_audio":
        return
    if state == "text_closed":
        await c.send(type="speak.end", utterance_id="u1")
    elif state == "interrupted":
        await c.send(type="speak.cancel", utterance_id="u1")
        await c.until("utterance.interrupted", "u1")
    elif state == "two_open":
        await c.send(type="speak.append", utterance_id="u2", text="more text here. ", flush=True)
        await c.until("utterance.started", "u2")
    elif state == "ending":
        await c.send(type="session.end")


@pytest.mark.parametrize("state", STATES)
async def test_disconnect_at_every_state_frees_everything(
    gateway_factory: GatewayFactory, state: str
) -> None:
    engine = FakeEngine(step_s=0.01)
    gw = gateway_factory(engine)
    gateway = gw.server.gateway
    loop_of_server = None
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await _drive_to(c, state)
        for _ in range(20):
            if gateway.sessions:
                loop_of_server = next(iter(gateway.sessions))._loop
                break
            await asyncio.sleep(0.01)
        ws.transport.abort()  # the client vanishes without a close frame
    for _ in range(200):
        await asyncio.sleep(0.02)
        if not gateway.sessions and not engine.active:
            break
    assert not gateway.sessions and not engine.active
    assert all(s.cancelled or s.finished for s in engine.streams)
    if loop_of_server is not None:
        names = [t.get_coro().__qualname__ for t in asyncio.all_tasks(loop_of_server)]
        assert not [n for n in names if n.startswith("Session.")], names


async def test_an_engine_failure_fails_only_its_utterance(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine()
    gw = gateway_factory(engine)
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="ok1", text="alpha beta", flush=True)
        await c.send(type="speak.end", utterance_id="ok1")
        await c.until("utterance.done", "ok1")
        engine.options.fail_after_words = 0  # the next word of any stream raises
        await c.send(type="speak.append", utterance_id="bad", text="gamma delta", flush=True)
        error = await c.until("error")
        assert error["code"] == "internal" and error["message"] == "injected engine failure"
        engine.options.fail_after_words = None
        await c.send(type="speak.append", utterance_id="ok2", text="epsilon", flush=True)
        await c.send(type="speak.end", utterance_id="ok2")
        done = await c.until("utterance.done", "ok2")
        assert done["packets"] > 0
    assert not engine.active


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parents[2]


async def test_sigterm_mid_utterance_drains_and_closes_with_1001() -> None:
    port = _free_port()
    command = [sys.executable, "-m", "tests.integration.serve_fake", str(port)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # noqa: ASYNC220
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("server did not start") from None
                await asyncio.sleep(0.1)
        async with connect(f"ws://127.0.0.1:{port}/v1/stream") as ws:
            c = Client(ws)
            await c.send(type="speak.append", utterance_id="u1", text="word " * 400, flush=True)
            await c.send(type="speak.end", utterance_id="u1")
            while len(c.got.packets) < 5:
                await c.next()
            os.kill(process.pid, signal.SIGTERM)
            sigterm_at = time.monotonic()
            with pytest.raises(ConnectionClosed):
                while True:
                    await c.next(10)
            assert ws.close_code == 1001
            assert time.monotonic() - sigterm_at < 5  # drain_timeout_s = 1 s, then the fence
            headers = [h for h, _ in c.got.packets]
            assert [h.seq for h in headers] == list(range(len(headers)))  # nothing lost on the way
        # uvicorn re-raises the captured SIGTERM after its orderly shutdown
        assert process.wait(timeout=15) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
