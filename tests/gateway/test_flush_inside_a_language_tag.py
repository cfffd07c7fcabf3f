"""`speak.flush` between the appends of a language tag split across them: the tag stays a tag (it is
not spoken as "<e" and "n>"); only the end of the utterance's text makes such a tail plain text."""

from __future__ import annotations

from engine.api import TextSegment
from gateway.segmenter import UtteranceText
from tests.gateway.test_protocol import Harness


def spoken(segments: list[TextSegment]) -> list[tuple[str, str | None]]:
    return [(s.text, s.language) for s in segments]


def test_a_flush_keeps_a_partial_tag_for_the_next_append() -> None:
    text = UtteranceText("English")
    out = text.feed("Hello. <d") + text.flush(final=False)
    out += text.feed("e>Guten Tag.</de> Bye.") + text.flush()
    assert spoken(out) == [("Hello. ", None), ("Guten Tag.", "German"), (" Bye.", None)]
    client = "Hello. <de>Guten Tag.</de> Bye."
    for s in out:
        assert all(client[s.source_offset(i)] == ch for i, ch in enumerate(s.text))


def test_the_end_of_the_text_speaks_a_tail_that_never_became_a_tag() -> None:
    text = UtteranceText("English")
    assert spoken(text.feed("a<b") + text.flush()) == [("a<b", None)]


def test_speak_flush_and_append_flush_between_the_halves_of_a_tag() -> None:
    for flush_message in ("speak.flush", "append.flush"):
        h = Harness()
        if flush_message == "speak.flush":
            h.send(type="speak.append", utterance_id="u1", text="Sure. <z")
            h.send(type="speak.flush", utterance_id="u1")
        else:
            h.send(type="speak.append", utterance_id="u1", text="Sure. <z", flush=True)
        h.send(type="speak.append", utterance_id="u1", text="h>你好</zh>")
        h.send(type="speak.end", utterance_id="u1")
        assert [s.text for s in h.pushed["u1"]] == ["Sure. ", "你好"], flush_message
