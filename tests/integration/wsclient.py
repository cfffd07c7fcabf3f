"""A small test client for /v1/stream: collects messages and packets per utterance."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from gateway.messages import PacketHeader, unpack_packet


@dataclass
class Received:
    messages: list[dict[str, Any]] = field(default_factory=list)
    packets: list[tuple[PacketHeader, bytes]] = field(default_factory=list)
    order: list[Any] = field(default_factory=list)  # dicts and headers, as they came

    def of_type(self, kind: str, utterance_id: str | None = None) -> list[dict[str, Any]]:
        return [
            m
            for m in self.messages
            if m["type"] == kind and (utterance_id is None or m.get("utterance_id") == utterance_id)
        ]

    def stream_of(self, utterance_id: str) -> int:
        return int(self.of_type("utterance.started", utterance_id)[0]["stream"])

    def packets_of(self, stream: int) -> list[tuple[PacketHeader, bytes]]:
        return [(h, p) for h, p in self.packets if h.stream == stream]

    def words_of(self, utterance_id: str) -> list[dict[str, Any]]:
        return [w for m in self.of_type("words", utterance_id) for w in m["words"]]


class Client:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.got = Received()

    async def send(self, **message: Any) -> None:
        await self.ws.send(json.dumps(message))

    async def next(self, wait_s: float = 10.0) -> dict[str, Any] | PacketHeader:
        frame = await asyncio.wait_for(self.ws.recv(), wait_s)
        if isinstance(frame, bytes):
            header, payload = unpack_packet(frame)
            self.got.packets.append((header, payload))
            self.got.order.append(header)
            return header
        message = json.loads(frame)
        self.got.messages.append(message)
        self.got.order.append(message)
        return message  # type: ignore[no-any-return]

    async def until(self, kind: str, utterance_id: str | None = None, wait_s: float = 10.0) -> dict[str, Any]:
        """Read until a message of `kind` (for `utterance_id`) arrives."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            item = await self.next(max(0.01, deadline - loop.time()))
            if (
                isinstance(item, dict)
                and item["type"] == kind
                and (utterance_id is None or item.get("utterance_id") == utterance_id)
            ):
                return item

    async def drain(self, quiet_s: float = 0.3) -> None:
        """Read until nothing arrives for quiet_s."""
        try:
            while True:
                await self.next(quiet_s)
        except TimeoutError:
            return


def connect(url: str, **options: Any) -> Any:
    return websockets.connect(url, max_size=None, **options)
