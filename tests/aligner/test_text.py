"""Unit splitting per language and the mapping of units back to the client's character offsets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligner.text import (
    UnitSplitter,
    canonical_language,
    clean,
    display_spans,
    locate_units,
    split_korean,
    split_korean_word,
    split_spaced,
)


def spans(text: str, language: str = "English", splitter: UnitSplitter | None = None) -> list[str]:
    units = (splitter or UnitSplitter()).units(text, language)
    return [text[start:end] for start, end in display_spans(text, units)]


def test_clean_keeps_letters_digits_and_apostrophes_only():
    assert clean("Don't-stop, 2024!") == "Don'tstop2024"
    assert clean("«ça»") == "ça"
    assert clean("...") == ""


def test_spaced_languages_split_on_whitespace_and_every_ideograph():
    assert split_spaced("Hello, world!  It's 9 o'clock.") == ["Hello", "world", "It's", "9", "o'clock"]
    assert split_spaced("我用iPhone拍照，很好。") == ["我", "用", "iPhone", "拍", "照", "很", "好"]
    assert split_spaced(" — ... ") == []


def test_language_names_and_codes():
    assert canonical_language(" Japanese ") == "japanese"
    assert canonical_language("ja") == "japanese"
    assert canonical_language("KO") == "korean"
    assert canonical_language("English") == "english"


def test_unit_spans_cover_exactly_the_kept_characters():
    text = "Sure,  I can't help (you) with foo-bar."
    units = locate_units(text, split_spaced(text))
    assert [(u.text, text[u.char_start : u.char_end]) for u in units] == [
        ("Sure", "Sure"),
        ("I", "I"),
        ("can't", "can't"),
        ("help", "help"),
        ("you", "you"),
        ("with", "with"),
        ("foobar", "foo-bar"),
    ]


def test_display_spans_take_attached_punctuation_but_never_whitespace():
    assert spans("Sure, I can help (you) with that.") == [
        "Sure,",
        "I",
        "can",
        "help",
        "(you)",
        "with",
        "that.",
    ]
    assert spans("“Quoted” — dash") == ["“Quoted”", "dash"]
    assert spans("你好，世界。", "Chinese") == ["你", "好，", "世", "界。"]


def test_normalising_segmenter_output_maps_back_to_the_original_characters():
    # A Japanese segmenter that normalises as nagisa does: full-width Latin to ASCII, half-width kana
    # (with a separate voicing mark) to full-width, ellipsis to dots, spaces to ideographic space.
    def normalising(text: str) -> list[str]:
        assert text == "ＡＢＣは ｶﾞｲﾄﾞです…"
        return ["ABC", "は", "\u3000", "ガイド", "です", "..."]

    splitter = UnitSplitter(japanese=normalising)
    text = "ＡＢＣは ｶﾞｲﾄﾞです…"
    units = splitter.units(text, "Japanese")
    assert [u.text for u in units] == ["ABC", "は", "ガイド", "です"]
    assert [text[u.char_start : u.char_end] for u in units] == ["ＡＢＣ", "は", "ｶﾞｲﾄﾞ", "です"]
    assert spans(text, "Japanese", splitter)[-1] == "です…"


def test_combining_marks_stay_with_their_letter():
    text = "cafe\u0301 ok"  # decomposed é: the mark is dropped from the unit, not from the span
    units = UnitSplitter().units(text, "French")
    assert [u.text for u in units] == ["cafe", "ok"]
    assert text[units[0].char_start : units[0].char_end] == "cafe\u0301"


def test_korean_left_part_is_the_highest_scoring_then_shortest():
    scores = {"학교": 1.0, "학교에서": 1.0, "안녕": 1.0}
    assert split_korean_word("학교에서는", scores) == ("학교에서", "는")  # equal scores: longest left
    assert split_korean_word("공부합니다", {"공부합": 1.0}) == ("공부합", "니다")
    assert split_korean_word("공부합니다", {"공부": 0.5, "공부합": 0.2}) == ("공부", "합니다")
    assert split_korean_word("공부합니다", {}) == ("공부합니다", "")
    assert split_korean_word("나는", scores) == ("나는", "")
    assert split_korean("안녕하세요, 학교에서!", scores) == ["안녕", "하세요", "학교에서"]
    assert split_korean("안녕하세요, 학교에서!", None) == ["안녕하세요", "학교에서"]


def test_korean_units_locate_in_the_text():
    splitter = UnitSplitter(korean_dictionary={"안녕": 1.0})
    text = "안녕하세요, 여러분!"
    assert spans(text, "ko", splitter) == ["안녕", "하세요,", "여러분!"]


WORDS = st.text(
    alphabet=st.sampled_from(list("abcXYZ'9é你好,.-!?()“” \t\n") + ["\u0301"]), min_size=0, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(WORDS)
def test_spans_are_ordered_disjoint_and_hold_their_units(text):
    units = UnitSplitter().units(text, "English")
    assert [u.text for u in units] == split_spaced(text)
    previous_end = 0
    for unit, (start, end) in zip(units, display_spans(text, units), strict=True):
        assert previous_end <= start <= unit.char_start <= unit.char_end <= end <= len(text)
        assert clean(text[unit.char_start : unit.char_end]) == unit.text
        assert clean(text[start:end]) == unit.text
        assert not any(ch.isspace() for ch in text[start:end])
        previous_end = end


@pytest.mark.reference
def test_korean_and_japanese_match_the_reference_segmenters():
    from pathlib import Path

    from tests.qwen_reference import import_qwen_asr

    qwen_asr = import_qwen_asr()
    pytest.importorskip("soynlp")
    from aligner.text import load_korean_dictionary, nagisa_segmenter

    processor = qwen_asr.inference.qwen3_forced_aligner.Qwen3ForceAlignProcessor()
    dictionary = (
        Path(qwen_asr.inference.qwen3_forced_aligner.__file__).parent / "assets" / "korean_dict_jieba.dict"
    )
    splitter = UnitSplitter(japanese=nagisa_segmenter(), korean_dictionary=load_korean_dictionary(dictionary))
    for text in [
        "안녕하세요, 여러분! 오늘 학교에서 공부했습니다.",
        "대한민국의 수도는 서울입니다 ㅋㅋ 2024년",
    ]:
        assert splitter.words(text, "Korean") == processor.encode_timestamp(text, "Korean")[0]
    for text in ["ＡＢＣは ｶﾞｲﾄﾞです…", "東京都に住んでいます。「すごい」と言った！"]:
        assert splitter.words(text, "Japanese") == processor.encode_timestamp(text, "Japanese")[0]
