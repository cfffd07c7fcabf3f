"""Word times -> ElevenLabs character alignment blocks, on both readings; ElevenLabs' output formats."""

from __future__ import annotations

import pytest

from gateway.compat.alignment import CharTimeline
from gateway.compat.elevenlabs import OutputFormat, parse_output_format

TEXT = "Hi, you there!"
WORDS = [
    {"start_ms": 0, "end_ms": 200, "char_start": 0, "char_end": 3},  # "Hi,"
    {"start_ms": 250, "end_ms": 400, "char_start": 4, "char_end": 7},  # "you"
    {"start_ms": 450, "end_ms": 700, "char_start": 8, "char_end": 14},  # "there!"
]


def absolute(blocks: list[dict[str, list[int]]], relative: bool) -> list[tuple[str, int, int]]:
    out, base = [], 0
    for block in blocks:
        offset = base if relative else 0
        out += [
            (c, offset + s, d)
            for c, s, d in zip(
                block["chars"], block["charStartTimesMs"], block["charDurationsMs"], strict=True
            )
        ]
        base = offset + block["charStartTimesMs"][-1] + block["charDurationsMs"][-1]
    return out


@pytest.mark.parametrize("relative", [False, True])
def test_every_character_once_in_order_and_contiguous(relative: bool) -> None:
    timeline = CharTimeline(relative)
    timeline.add_text(TEXT)
    blocks = []
    for word in WORDS:
        timeline.add_words([word])
        blocks.append(timeline.take())
    timeline.finish(760)
    blocks.append(timeline.take())
    assert timeline.take() is None
    chars = absolute([b for b in blocks if b], relative)
    assert "".join(c for c, _, _ in chars) == TEXT + " "  # a closing space: Pipecat's word end
    for (_, s0, d0), (_, s1, _) in zip(chars, chars[1:], strict=False):
        assert s0 + d0 == s1  # no gap, no overlap
    starts = {TEXT[w["char_start"] : w["char_end"]]: w["start_ms"] for w in WORDS}
    assert {word: chars[TEXT.index(word)][1] for word in starts} == starts
    assert chars[-1][1] + chars[-1][2] == 760


def test_both_readings_agree() -> None:
    result = {}
    for relative in (False, True):
        timeline = CharTimeline(relative)
        timeline.add_text(TEXT)
        blocks = []
        for word in WORDS:
            timeline.add_words([word])
            blocks.append(timeline.take())
        timeline.finish(700)
        blocks.append(timeline.take())
        result[relative] = absolute([b for b in blocks if b], relative)
    assert result[False] == result[True]


def test_words_out_of_range_or_repeated_are_skipped() -> None:
    timeline = CharTimeline(relative=False)
    timeline.add_text("one two")
    timeline.add_words([{"start_ms": 0, "end_ms": 100, "char_start": 0, "char_end": 3}])
    timeline.add_words([{"start_ms": 0, "end_ms": 100, "char_start": 0, "char_end": 3}])  # again
    timeline.add_words([{"start_ms": 150, "end_ms": 300, "char_start": 4, "char_end": 99}])  # past the text
    block = timeline.take()
    assert block is not None and "".join(block["chars"]) == "one"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("pcm_16000", OutputFormat("pcm_s16le", 16000)),
        ("ulaw_8000", OutputFormat("mulaw", 8000)),
        ("alaw_8000", OutputFormat("alaw", 8000)),
        ("mp3_44100_128", OutputFormat("pcm_s16le", 44100, "mp3", 128_000)),
        ("opus_48000_64", OutputFormat("pcm_s16le", 48000, "opus", 64_000)),
    ],
)
def test_output_formats(name: str, expected: OutputFormat) -> None:
    assert parse_output_format(name) == expected


@pytest.mark.parametrize(
    "name", ["pcm_32000", "ulaw_16000", "mp3_44100", "opus_24000_32", "wav_44100", "pcm_16000_8"]
)
def test_output_formats_refused(name: str) -> None:
    with pytest.raises(ValueError):
        parse_output_format(name)
