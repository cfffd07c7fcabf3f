"""The session's `alignment` option over a real socket: sync words precede their audio; async and
`timestamps: none` reach the stage as the stream's mode."""

from __future__ import annotations

from engine.alignment.engine import AlignedEngine
from gateway.messages import PacketHeader
from tests.engine.alignment.fakes import SpreadAligner
from tests.fakes import FakeEngine
from tests.integration.conftest import run_gateway
from tests.integration.wsclient import Client, connect

TEXT = "Hello there. How are you today? Fine, thanks."


class RecordingAlignedEngine(AlignedEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.opened: list = []

    def open(self, request):
        stream = super().open(request)
        self.opened.append(stream)
        return stream


async def speak(url: str, **start: object) -> Client:
    async with connect(url) as ws:
        client = Client(ws)
        await client.send(type="session.start", **start)
        await client.send(type="speak.append", utterance_id="u", text=TEXT)
        await client.send(type="speak.end", utterance_id="u")
        await client.until("utterance.done", "u")
        return client


async def test_sync_and_async_modes_through_the_gateway():
    engine = RecordingAlignedEngine(FakeEngine(chunk_ms=40), SpreadAligner())
    with run_gateway(engine) as gateway:
        synced = await speak(gateway.ws, alignment="sync")
        asynced = await speak(gateway.ws, alignment="async")
        silent = await speak(gateway.ws, timestamps="none")
        modes = [s.mode for s in engine.opened]
    assert modes == ["sync", "async", "off"]
    for client in (synced, asynced):
        words = client.got.words_of("u")
        assert [w["text"] for w in words] == TEXT.split()
        assert {m["source"] for m in client.got.of_type("words")} == {"aligner"}
    # sync: when a packet arrives, every word that ends before it has already been sent
    all_words, seen = synced.got.words_of("u"), 0
    for item in synced.got.order:
        if isinstance(item, dict) and item["type"] == "words":
            seen += len(item["words"])
        elif isinstance(item, PacketHeader):
            start_ms = item.sample_offset * 1000 // 24000
            assert sum(w["end_ms"] <= start_ms for w in all_words) <= seen
    first = next(i for i in synced.got.order if isinstance(i, PacketHeader) or i["type"] == "words")
    assert first is synced.got.of_type("words")[0]  # sync: the first words come before the first packet
    assert silent.got.of_type("words") == []
    assert len(engine.sync_delays_ms()) == 1
