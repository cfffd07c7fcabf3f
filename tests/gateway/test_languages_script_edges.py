"""The Auto rule counts letters only: punctuation and emoji that sit in CJK code blocks or far
planes do not pick a language."""

from __future__ import annotations

from gateway.languages import detect_language

SCOTLAND = "🏴\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f"  # a flag made of tag characters


def test_an_emoji_tag_sequence_is_not_han() -> None:
    assert detect_language(f"Go Scotland {SCOTLAND}!") == "English"
    assert detect_language(SCOTLAND) is None


def test_katakana_middle_dot_in_chinese_is_not_kana() -> None:
    assert detect_language("我喜欢哈利・波特这本书。") == "Chinese"
    assert detect_language("ハリー・ポッター") == "Japanese"


def test_han_beyond_the_basic_plane_still_counts() -> None:
    assert detect_language("\U00020000\U0002a700\U00030000") == "Chinese"
