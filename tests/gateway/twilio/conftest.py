"""The real gateway with the eSpeak engine on loopback uvicorn, and the agent's control socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from engine.espeak.engine import EspeakEngine
from tests.integration.conftest import RunningGateway, run_gateway


@pytest.fixture
def espeak_gateway() -> Iterator[RunningGateway]:
    with run_gateway(EspeakEngine()) as running:
        yield running


def twilio_url(gateway: RunningGateway) -> str:
    return f"ws://127.0.0.1:{gateway.port}/v1/twilio"


class Agent:
    """The voice agent's end of `WS /v1/twilio/control/{callSid}`: sends text, collects events."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.messages: list[dict[str, Any]] = []
        self._arrived = asyncio.Event()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in self.ws:
                self.messages.append(json.loads(frame))
                self._arrived.set()

    async def send(self, **message: Any) -> None:
        await self.ws.send(json.dumps(message))

    async def say(self, utterance_id: str, text: str) -> None:
        await self.send(type="speak.append", utterance_id=utterance_id, text=text)
        await self.send(type="speak.end", utterance_id=utterance_id)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == kind]

    def words(self, utterance_id: str) -> list[dict[str, Any]]:
        return [w for m in self.of_type("words") if m["utterance_id"] == utterance_id for w in m["words"]]

    async def until(self, kind: str, timeout_s: float = 15.0, **fields: Any) -> dict[str, Any]:
        async def wait() -> dict[str, Any]:
            while True:
                for message in self.messages:
                    if message["type"] == kind and all(message.get(k) == v for k, v in fields.items()):
                        return message
                self._arrived.clear()
                await self._arrived.wait()

        return await asyncio.wait_for(wait(), timeout_s)

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def agent_for(gateway: RunningGateway, call_sid: str, credential: str | None = None) -> Any:
    """The call's control channel, with a key or token as its Bearer credential when given."""
    headers = {"Authorization": f"Bearer {credential}"} if credential is not None else None
    ws = await websockets.connect(
        f"ws://127.0.0.1:{gateway.port}/v1/twilio/control/{call_sid}",
        additional_headers=headers,
        max_size=None,
    )
    agent = Agent(ws)
    try:
        yield agent
    finally:
        await agent.close()
