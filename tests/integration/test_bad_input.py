"""Each bad input gets its typed error and ends at most one request: never the session, never the
server. Over real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.exceptions import ConnectionClosed

from gateway.config import GatewayConfig
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory, RunningGateway
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(60)


async def finish(c: Client, uid: str, text: str = "still speaking fine") -> dict[str, object]:
    await c.send(type="speak.append", utterance_id=uid, text=text)
    await c.send(type="speak.end", utterance_id=uid)
    return await c.until("utterance.done", uid)


BAD_FRAMES: list[tuple[str | bytes, str]] = [
    ("this is not json", "invalid_message"),
    ("[1, 2, 3]", "invalid_message"),
    ('{"utterance_id": "x"}', "invalid_message"),
    ('{"type": "speak.dance"}', "unknown_type"),
    ('{"type": "speak.append", "utterance_id": "u9", "text": 42}', "invalid_message"),
    ('{"type": "speak.cancel", "utterance_id": "u1", "played_ms": -5}', "invalid_message"),
    (
        '{"type": "session.start", "output": {"encoding": "mulaw", "sample_rate": 24000}}',
        "unsupported_output",
    ),
    ('{"type": "speak.flush", "utterance_id": "ghost"}', "unknown_utterance"),
    ('{"type": "speak.cancel", "utterance_id": "ghost"}', "unknown_utterance"),
    ('{"type": "playback.report", "utterance_id": "ghost", "played_ms": 3}', "unknown_utterance"),
    ('{"type": "speak.resume", "utterance_id": "r", "from_utterance": "ghost"}', "unknown_utterance"),
    ('{"type": "speak.append", "utterance_id": "u1", "text": "\\ud800"}', "invalid_message"),
]


@pytest.mark.parametrize(("frame", "code"), BAD_FRAMES)
async def test_bad_message_mid_utterance(gateway_factory: GatewayFactory, frame: str, code: str) -> None:
    g = gateway_factory(FakeEngine(step_s=0.002))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="one two three four")
        await c.until("utterance.started", "u1")
        await ws.send(frame)
        error = await c.until("error")
        assert error["code"] == code and error["message"]
        await c.send(type="speak.end", utterance_id="u1")
        done = await c.until("utterance.done", "u1")
        assert done["packets"] > 0
        await finish(c, "u2")


async def test_invalid_utf8_text_frame(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await ws.send(b'{"type":"speak.append","utterance_id":"u","text":"\xff\xfe"}', text=True)
        error = await c.until("error")
        assert error["code"] == "invalid_message" and "UTF-8" in error["message"]
        await finish(c, "u1")


async def test_binary_frame_from_the_client(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await ws.send(b"\x01\x02\x03")
        assert (await c.until("error"))["code"] == "binary_not_supported"
        await finish(c, "u1")


async def test_oversized_frame_closes_only_that_socket(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(), GatewayConfig(max_message_bytes=4096))
    async with connect(g.ws) as other, connect(g.ws) as ws:
        bystander = Client(other)
        await bystander.send(type="speak.append", utterance_id="b1", text="I keep talking")
        await ws.send(json.dumps({"type": "speak.append", "utterance_id": "u1", "text": "x" * 10_000}))
        with pytest.raises(ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 5)
        assert ws.close_code == 1009
        await bystander.send(type="speak.end", utterance_id="b1")
        await bystander.until("utterance.done", "b1")
    async with connect(g.ws) as again:
        await finish(Client(again), "u2")


async def test_text_too_long(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(), GatewayConfig(max_text_chars=50))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="a" * 30 + " ")
        await c.send(type="speak.append", utterance_id="u1", text="b" * 30)
        error = await c.until("error")
        assert (error["code"], error["utterance_id"]) == ("text_too_long", "u1")
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
        assert [w["text"] for w in c.got.words_of("u1")] == ["a" * 30]


async def test_unknown_voice(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", voice="nobody")
        await c.send(type="speak.append", utterance_id="u1", text="hi")
        error = await c.until("error")
        assert (error["code"], error["utterance_id"]) == ("unknown_voice", "u1")
    async with connect(gateway.ws) as ws:
        await finish(Client(ws), "u1")


async def test_overloaded_refuses_the_new_utterance_only(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(capacity=1, step_s=0.002))
    async with connect(g.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="one two three")
        await c.until("utterance.started", "u1")
        await c.send(type="speak.append", utterance_id="u2", text="four")
        error = await c.until("error")
        assert (error["code"], error["utterance_id"]) == ("overloaded", "u2")
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
        await asyncio.sleep(0.05)
        await finish(c, "u2")  # capacity is back: the same id works now


async def test_too_many_utterances(gateway_factory: GatewayFactory) -> None:
    g = gateway_factory(FakeEngine(), GatewayConfig(max_open_utterances=2))
    async with connect(g.ws) as ws:
        c = Client(ws)
        for uid in ("a", "b", "c"):
            await c.send(type="speak.append", utterance_id=uid, text="word")
        error = await c.until("error")
        assert (error["code"], error["utterance_id"]) == ("too_many_utterances", "c")
        for uid in ("a", "b"):
            await c.send(type="speak.end", utterance_id=uid)
        await c.until("utterance.done", "b")


async def test_engine_failure_ends_one_utterance(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine(fail_after_words=3)
    g = gateway_factory(engine)
    async with connect(g.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="one two three four five")
        await c.send(type="speak.end", utterance_id="u1")
        error = await c.until("error")
        assert (error["code"], error["utterance_id"]) == ("internal", "u1")
        await finish(c, "u2", "six seven")
        assert not c.got.of_type("utterance.done", "u1")


async def test_disconnect_mid_utterance_frees_the_engine(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine(step_s=0.01)
    g = gateway_factory(engine)
    async with connect(g.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text="one two three four five six seven")
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.started", "u1")
        await c.next()
    for _ in range(100):
        if not engine.active:
            break
        await asyncio.sleep(0.02)
    assert not engine.active and engine.streams[0].cancelled
    async with connect(g.ws) as ws:
        await finish(Client(ws), "u1")


async def test_a_burst_of_garbage_then_real_work(gateway: RunningGateway) -> None:
    async with connect(gateway.ws) as ws:
        c = Client(ws)
        for frame, _ in BAD_FRAMES:
            await ws.send(frame)
        await ws.send(b"\x00" * 10)
        await finish(c, "u1")
        codes = [m["code"] for m in c.got.of_type("error")]
        assert len(codes) == len(BAD_FRAMES) + 1
