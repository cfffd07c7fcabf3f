"""Barge-in accuracy over real loopback with the eSpeak engine, English and Mandarin.

Hundreds of random interrupts, spread over parallel sessions: the played position comes from the
cancel (anywhere in the utterance), from playback reports only, or from neither (the server's
clock). Each `utterance.interrupted` is checked against the words the server sent before it, by the
rules of the protocol: `last_word` is the last word ending by played_ms + 40, `partial_word` the
word being spoken at played_ms, `spoken_text` runs to last_word.char_end and `unspoken_text` is the
rest; `position_source` names where played_ms came from, and played_ms lies where that source
allows. No packet of the stream may follow the fence.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest

from gateway.messages import PacketHeader
from tests.integration.conftest import GatewayFactory
from tests.integration.wsclient import Client, connect

pytest.importorskip("espeakng_loader")
espeak = pytest.importorskip("engine.espeak.engine")

SESSIONS = 12
UTTERANCES_PER_SESSION = 20  # 240 interrupts in all
RATE = 24_000
TOLERANCE_MS = 40  # the protocol's end-of-word tolerance
SLACK_MS = 150  # scheduling slack on the server's clock (loaded CI machines)

ENGLISH = (
    "sure",
    "I",
    "can",
    "help",
    "you",
    "with",
    "that",
    "today",
    "the",
    "weather",
    "looks",
    "fine",
    "please",
    "hold",
    "on",
    "while",
    "check",
    "your",
    "order",
    "number",
    "again",
)
MANDARIN = "我可以帮你今天天气很好请稍等一下查看订单号码谢谢再见朋友们"


def english_text(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 2)):
        words = [rng.choice(ENGLISH) for _ in range(rng.randint(3, 7))]
        if len(words) > 4 and rng.random() < 0.5:
            words[2] += ","
        sentences.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return " ".join(sentences)


def mandarin_text(rng: random.Random) -> str:
    out = ""
    for _ in range(rng.randint(1, 2)):
        out += "".join(rng.choice(MANDARIN) for _ in range(rng.randint(3, 8))) + rng.choice("，。？！")
    return out


@dataclass
class Case:
    uid: str
    language: str
    text: str
    how: str  # "client" | "report" | "server"
    played_ms: int | None = None  # sent in the cancel ("client")
    report_ms: int | None = None  # the last playback.report ("report")
    low_ms: float = 0.0  # bounds on played_ms where the server chooses it
    high_ms: float = 0.0


def received_ms(client: Client, stream: int) -> int:
    """Audio of `stream` received so far, in ms (pcm_s16le: 2 bytes a sample)."""
    packets = client.got.packets_of(stream)
    if not packets:
        return 0
    header, payload = packets[-1]
    return (header.sample_offset + len(payload) // 2) * 1000 // RATE


async def read_until(client: Client, done: Any, wait_s: float = 10.0) -> None:
    """Read frames until `done()` holds (checked after each frame)."""
    deadline = time.monotonic() + wait_s
    while not done():
        await client.next(max(0.01, deadline - time.monotonic()))


def expected_cut(words: list[dict[str, Any]], text: str, played: int) -> dict[str, Any]:
    """The protocol's barge-in rules, applied to the words the client was sent."""
    last = None
    for w in words:
        if w["end_ms"] <= played + TOLERANCE_MS:
            last = w
    partial = next(
        (
            w
            for w in words
            if w["start_ms"] <= played < w["end_ms"] and (last is None or w["index"] > last["index"])
        ),
        None,
    )
    split = last["char_end"] if last else 0
    return {
        "last_word": last,
        "partial_word": partial,
        "spoken_text": text[:split],
        "unspoken_text": text[split:],
    }


async def run_case(client: Client, case: Case, rng: random.Random) -> None:
    began = time.monotonic()
    await client.send(type="speak.append", utterance_id=case.uid, text=case.text)
    await client.send(type="speak.end", utterance_id=case.uid)
    started = await client.until("utterance.started", case.uid)
    stream = started["stream"]
    finished = lambda: bool(client.got.of_type("utterance.done", case.uid))  # noqa: E731
    # about 70 ms of speech a character in English, 250 in Mandarin: aim anywhere inside it
    estimate_ms = len(case.text) * (70 if case.language == "English" else 250)
    target = rng.randint(0, estimate_ms)
    first_packet_at: float | None = None

    def progressed() -> bool:
        nonlocal first_packet_at
        if first_packet_at is None and client.got.packets_of(stream):
            first_packet_at = time.monotonic()
        return finished() or received_ms(client, stream) >= target

    await read_until(client, progressed)
    if first_packet_at is None and client.got.packets_of(stream):
        first_packet_at = time.monotonic()
    cancel: dict[str, Any] = {"type": "speak.cancel", "utterance_id": case.uid}
    if case.how == "client":
        case.played_ms = target
        cancel["played_ms"] = target
    elif case.how == "report":
        case.report_ms = min(target, received_ms(client, stream))
        report_sent = time.monotonic()
        await client.send(type="playback.report", utterance_id=case.uid, played_ms=case.report_ms)
        await asyncio.sleep(rng.random() * 0.02)
    before_cancel = time.monotonic()
    at_cancel_ms = received_ms(client, stream)
    was_finished = finished()
    await client.send(**cancel)
    reply = await client.until("utterance.interrupted", case.uid)
    after = time.monotonic()
    duration = client.got.of_type("utterance.done", case.uid)[0]["duration_ms"] if finished() else None
    if case.how == "client":
        case.low_ms = case.high_ms = target
        if not was_finished and at_cancel_ms < target:  # the server caps at what it has sent
            case.low_ms = at_cancel_ms
        if duration is not None:
            case.low_ms, case.high_ms = min(case.low_ms, duration), min(case.high_ms, duration)
    elif case.how == "report":
        assert case.report_ms is not None
        case.low_ms = case.report_ms
        # the server extrapolates from the report's arrival: no later than its sending, here
        case.high_ms = case.report_ms + (after - report_sent) * 1000 + SLACK_MS
    else:
        assert first_packet_at is not None
        case.low_ms = min((before_cancel - first_packet_at) * 1000, at_cancel_ms)
        case.high_ms = (after - began) * 1000 + SLACK_MS
    check_reply(client, case, reply, stream)


def check_reply(client: Client, case: Case, reply: dict[str, Any], stream: int) -> None:
    where = f"{case.uid} ({case.language}, {case.how}): {reply}"
    assert reply["position_source"] == case.how, where
    played = reply["played_ms"]
    assert case.low_ms - 1 <= played <= case.high_ms + 1, (where, case.low_ms, case.high_ms)
    # the words the client had been sent before the fence
    fence = next(i for i, item in enumerate(client.got.order) if isinstance(item, dict) and item is reply)
    words = [
        w
        for item in client.got.order[:fence]
        if isinstance(item, dict) and item["type"] == "words" and item["utterance_id"] == case.uid
        for w in item["words"]
    ]
    assert words and [w["index"] for w in words] == list(range(len(words))), where
    assert all(case.text[w["char_start"] : w["char_end"]] == w["text"] for w in words), where
    expected = expected_cut(words, case.text, played)
    for key, value in expected.items():
        assert reply[key] == value, (key, where)
    assert reply["spoken_text"] + reply["unspoken_text"] == case.text
    if reply["last_word"] is not None:  # the listener heard it: it ended by the played position
        assert reply["last_word"]["end_ms"] <= played + TOLERANCE_MS
    assert not any(
        isinstance(item, PacketHeader) and item.stream == stream for item in client.got.order[fence:]
    ), f"a packet of stream {stream} followed the fence: {where}"


async def run_session(url: str, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases: list[Case] = []
    async with connect(url) as ws:
        client = Client(ws)
        await client.send(type="session.start", pacing="asap", timestamps="word")
        await client.until("session.started")
        for n in range(UTTERANCES_PER_SESSION):
            language = "English" if rng.random() < 0.5 else "Chinese"
            text = english_text(rng) if language == "English" else mandarin_text(rng)
            how = ("client", "report", "server")[n % 3]
            case = Case(f"s{seed}-u{n}", language, text, how)
            cases.append(case)
            await run_case(client, case, rng)
        await client.send(type="session.end")
        await client.until("session.ended")
        for case in cases:  # the fence held for the whole session, not only until the reply
            reply = client.got.of_type("utterance.interrupted", case.uid)[0]
            check_reply(client, case, reply, client.got.stream_of(case.uid))
    return cases


@pytest.mark.timeout(120)
async def test_hundreds_of_random_interrupts_english_and_mandarin(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory(espeak.EspeakEngine())
    sessions = await asyncio.gather(*(run_session(gateway.ws, seed) for seed in range(SESSIONS)))
    cases = [c for s in sessions for c in s]
    assert len(cases) == SESSIONS * UTTERANCES_PER_SESSION >= 200
    for how in ("client", "report", "server"):
        for language in ("English", "Chinese"):
            assert sum(c.how == how and c.language == language for c in cases) >= 25, (how, language)
