"""Text the way agents write it, end to end over loopback: language tags and Auto, a long text
streamed token by token, a continuous timeline across segments, barge-in in every segment, and
no gaps at segment joins with the eSpeak engine."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import numpy as np
import pytest

from engine.api import SynthesisRequest, TextSegment
from gateway.config import GatewayConfig
from gateway.segmenter import UtteranceText
from tests.fakes import FakeEngine
from tests.integration.conftest import GatewayFactory
from tests.integration.wsclient import Client, connect

pytestmark = pytest.mark.timeout(120)


def tokens(text: str, rng: random.Random) -> list[str]:
    """Cut a text into LLM-like tokens of 1 to 6 characters."""
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def check_timeline(text: str, words: list[dict[str, Any]]) -> None:
    assert [w["index"] for w in words] == list(range(len(words)))
    for prev, w in zip(words, words[1:], strict=False):
        assert w["start_ms"] >= prev["end_ms"]
        assert w["char_start"] >= prev["char_end"]
    for w in words:
        assert text[w["char_start"] : w["char_end"]] == w["text"]


async def test_mixed_chinese_english_with_tags(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine()
    gw = gateway_factory(engine)
    text = "<zh>请帮我订一台</zh> <en>iPhone 15</en>，<zh>谢谢。</zh>"
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="u1", text=text)
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
    pushed = engine.streams[0].pushed
    assert [(s.text, s.language) for s in pushed] == [
        ("请帮我订一台 ", "Chinese"),
        ("iPhone 15，", "English"),
        ("谢谢。", "Chinese"),
    ]
    words = c.got.words_of("u1")
    assert [w["text"] for w in words] == ["请帮我订一台", "iPhone", "15，", "谢谢。"]
    for w in words:  # offsets into the text as sent; a span may hold a removed tag
        assert re.sub(r"</?(zh|en)>", "", text[w["char_start"] : w["char_end"]]) == w["text"]
    assert text[words[0]["char_start"]] == "请" and text[words[1]["char_start"]] == "i"


async def test_mixed_chinese_english_with_auto(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine()
    gw = gateway_factory(engine)
    text = "请帮我订一台 iPhone 15。 Thanks a lot, see you tomorrow. 明天见！"
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", language="Auto")
        for piece in tokens(text, random.Random(3)):
            await c.send(type="speak.append", utterance_id="u1", text=piece)
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
    pushed = engine.streams[0].pushed
    assert [s.language for s in pushed] == ["Chinese", "English", "Chinese"]
    assert engine.streams[0].request.language == "Auto"
    check_timeline(text, c.got.words_of("u1"))


async def test_explicit_session_language_is_normalised_and_untagged_segments_use_it(
    gateway_factory: GatewayFactory,
) -> None:
    engine = FakeEngine()
    gw = gateway_factory(engine)
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await c.send(type="session.start", language="en-US")
        await c.send(type="speak.append", utterance_id="u1", text="Hello. <zh>你好。</zh>", flush=True)
        await c.send(type="speak.end", utterance_id="u1")
        await c.until("utterance.done", "u1")
    stream = engine.streams[0]
    assert stream.request.language == "English"
    assert [(s.text, s.language) for s in stream.pushed] == [("Hello. ", None), ("你好。", "Chinese")]


LONG = " ".join(
    f"Sentence number {i} talks about item {i * 7}, priced at {i}.{i % 10}9 dollars; "
    f"see https://example.com/items/{i}?ref=a.b for details."
    for i in range(40)
)


async def test_a_3000_character_text_streamed_token_by_token(gateway_factory: GatewayFactory) -> None:
    assert len(LONG) >= 3000
    engine = FakeEngine()
    gw = gateway_factory(engine, GatewayConfig(segment_max_chars=120))
    async with connect(gw.ws) as ws:
        c = Client(ws)
        for piece in tokens(LONG, random.Random(7)):
            await c.send(type="speak.append", utterance_id="u1", text=piece)
        await c.send(type="speak.end", utterance_id="u1")
        done = await c.until("utterance.done", "u1", wait_s=60)
    pushed = engine.streams[0].pushed
    assert "".join(s.text for s in pushed) == LONG
    assert len(pushed) >= 40 and all(len(s.text) <= 120 for s in pushed)
    for s in pushed:  # never inside a number or URL
        assert not re.search(r"\d\.$|example\.$|https:$", s.text.rstrip())
    words = c.got.words_of("u1")
    assert [w["text"] for w in words] == LONG.split()
    check_timeline(LONG, words)
    assert words[-1]["end_ms"] <= done["duration_ms"]
    packets = c.got.packets_of(c.got.stream_of("u1"))
    assert [h.sample_offset for h, _ in packets] == [i * 480 for i in range(len(packets))]


SEGMENTED = "First part is here. Second part follows now. Third one is short. And the fourth ends it."


async def test_barge_in_in_each_segment_reports_the_right_word(gateway_factory: GatewayFactory) -> None:
    engine = FakeEngine()
    gw = gateway_factory(engine)
    async with connect(gw.ws) as ws:
        c = Client(ws)
        await c.send(type="speak.append", utterance_id="probe", text=SEGMENTED)
        await c.send(type="speak.end", utterance_id="probe")
        await c.until("utterance.done", "probe")
        words = c.got.words_of("probe")
        segments = engine.streams[0].pushed
        assert len(segments) == 4
        for k, segment in enumerate(segments):
            # the second word of segment k, cut in its middle
            inside = [
                w
                for w in words
                if segment.char_start <= w["char_start"] < segment.char_start + len(segment.text)
            ]
            target = inside[1]
            uid = f"u{k}"
            await c.send(type="speak.append", utterance_id=uid, text=SEGMENTED)
            await c.send(type="speak.end", utterance_id=uid)
            await c.until("utterance.done", uid)
            played = (target["start_ms"] + target["end_ms"]) // 2
            await c.send(type="speak.cancel", utterance_id=uid, played_ms=played)
            cut = await c.until("utterance.interrupted", uid)
            assert cut["partial_word"]["index"] == target["index"]
            assert cut["last_word"]["index"] == target["index"] - 1
            assert cut["unspoken_text"] == SEGMENTED[inside[0]["char_end"] :]
            assert cut["spoken_text"] + cut["unspoken_text"] == SEGMENTED
            for later in segments[k + 1 :]:
                assert later.text.strip() in cut["unspoken_text"]


# -- eSpeak: no gap at segment joins ------------------------------------------------------------

espeak = pytest.importorskip("engine.espeak.engine")


def _silences(samples: np.ndarray, rate: int, floor: float = 0.01) -> list[int]:
    """Lengths (samples) of the silent runs between sounds, in order."""
    loud = np.flatnonzero(np.abs(samples) > floor)
    if len(loud) < 2:
        return []
    gaps = np.diff(loud)
    return [int(g) for g in gaps if g > rate // 100]


async def _synthesise(engine: Any, segments: list[TextSegment]) -> tuple[np.ndarray, list[float]]:
    """Audio of one utterance, and each chunk's lateness (s) against real-time playback from the
    first chunk (negative: ready before it is due)."""
    stream = engine.open(SynthesisRequest(request_id=f"gap-{len(segments)}", language="English"))
    for s in segments:
        stream.push(s)
    stream.close_text()
    loop = asyncio.get_running_loop()
    pieces, lateness, t0 = [], [], None
    async for chunk in stream:
        now = loop.time()
        if t0 is None and len(chunk.samples):
            t0 = now
        if t0 is not None:
            lateness.append(now - t0 - chunk.sample_offset / engine.info.sample_rate)
        pieces.append(np.asarray(chunk.samples, np.float32))
    return np.concatenate(pieces), lateness


async def test_espeak_segment_joins_add_no_silence_beyond_the_punctuation() -> None:
    try:
        engine = espeak.EspeakEngine()
        await engine.start()
    except Exception as exc:  # no eSpeak library on this machine
        pytest.skip(f"eSpeak unavailable: {exc}")
    try:
        text = (
            "Thank you for calling, this is the front desk. Your room is ready now. "
            "Breakfast is served from seven until ten. Have a pleasant stay."
        )
        pipeline = UtteranceText("English", max_chars=300, clause_min_chars=20)
        segmented = pipeline.feed(text) + pipeline.flush()
        assert len(segmented) >= 4
        whole_audio, _ = await _synthesise(engine, [TextSegment(text, 0)])
        seg_audio, lateness = await _synthesise(engine, segmented)
        rate = engine.info.sample_rate
        whole_gaps, seg_gaps = _silences(whole_audio, rate), _silences(seg_audio, rate)
        # the same pauses, within 20 ms each: a join adds nothing the punctuation does not imply
        extra_ms = (len(seg_audio) - len(whole_audio)) * 1000 / rate
        print(
            f"segment joins: {len(segmented) - 1}, extra audio {extra_ms:.1f} ms, "
            f"longest pause whole {max(whole_gaps) * 1000 / rate:.0f} ms, "
            f"segmented {max(seg_gaps) * 1000 / rate:.0f} ms"
        )
        assert abs(extra_ms) <= 20 * len(segmented)
        assert max(seg_gaps) <= max(whole_gaps) + rate // 50
        # every chunk is ready before real-time playback from the first one needs it
        assert max(lateness) < 0.05
    finally:
        await engine.stop()
