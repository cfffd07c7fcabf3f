"""Language tags, the Auto rule, and language-aware segmentation (gateway.languages, UtteranceText)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.api import TextSegment
from gateway.languages import LanguageTagger, detect_language, languages_open_at, normalise_language
from gateway.segmenter import UtteranceText


def segments(text: str, language: str = "Auto", step: int | None = None, **options: int) -> list[TextSegment]:
    pipeline = UtteranceText(language, **options)
    out: list[TextSegment] = []
    step = step or len(text) or 1
    for i in range(0, len(text), step):
        out += pipeline.feed(text[i : i + step])
    return out + pipeline.flush()


def spoken(segs: list[TextSegment]) -> list[tuple[str, str | None]]:
    return [(s.text, s.language) for s in segs]


def check_offsets(text: str, segs: list[TextSegment]) -> None:
    """Every spoken character maps to the same character in the client's text."""
    for s in segs:
        for i, ch in enumerate(s.text):
            assert text[s.source_offset(i)] == ch


def test_tags_select_the_language_and_are_not_spoken() -> None:
    text = "<zh>购买</zh><en>iPhone 15</en>"
    segs = segments(text)
    assert spoken(segs) == [("购买", "Chinese"), ("iPhone 15", "English")]
    check_offsets(text, segs)
    assert segs[1].source_offset(0) == text.index("iPhone")
    assert segs[1].source_offset(len("iPhone 15")) == text.index("</en>")


def test_untagged_text_uses_the_session_language_and_tags_override_it() -> None:
    segs = segments("Hello there. <de>Guten Tag.</de> Bye.", language="English")
    assert spoken(segs) == [("Hello there. ", None), ("Guten Tag.", "German"), (" Bye.", None)]


def test_auto_picks_chinese_for_mixed_chinese_with_a_latin_product_name() -> None:
    segs = segments("请帮我订一台 iPhone 15。Thank you very much, that is all.")
    assert spoken(segs) == [
        ("请帮我订一台 iPhone 15。", "Chinese"),
        ("Thank you very much, that is all.", "English"),
    ]


def test_tags_split_across_appends_give_the_same_segments() -> None:
    text = "Sure. <zh>请帮我订一台</zh> <en-US>iPhone 15</en-US>, <JA>ありがとう</JA>!"
    whole = segments(text)
    for step in (1, 2, 3, 5):
        assert spoken(segments(text, step=step)) == spoken(whole)
        check_offsets(text, segments(text, step=step))
    assert spoken(whole) == [
        ("Sure. ", "English"),
        ("请帮我订一台 ", "Chinese"),
        ("iPhone 15, ", "English"),
        ("ありがとう!", "Japanese"),
    ]


def test_markup_that_is_not_a_language_tag_is_spoken_as_text() -> None:
    text = "if a <b and c> d then <b>bold</b> <xx>yes</xx>"
    segs = segments(text, language="English")
    assert "".join(s.text for s in segs) == text
    assert all(s.char_map is None for s in segs)


def test_a_partial_tag_at_the_end_of_the_text_is_spoken() -> None:
    assert "".join(s.text for s in segments("price < 5 <e", language="English")) == "price < 5 <e"


def test_nested_and_unbalanced_tags() -> None:
    tagger = LanguageTagger()
    runs = tagger.feed("<en>a <zh>中文</zh> b</fr> c</en> d</en>") + tagger.flush()
    assert [(r.language, r.text) for r in runs] == [
        ("English", "a "),
        ("Chinese", "中文"),
        ("English", " b"),
        ("English", " c"),
        (None, " d"),
    ]


def test_languages_open_at_an_offset() -> None:
    text = "<en>Hello <zh>你好 世界</zh> again</en>"
    assert languages_open_at(text, text.index("世界")) == ("English", "Chinese")
    assert languages_open_at(text, text.index("again")) == ("English",)


def test_resumed_text_keeps_the_open_tag_language() -> None:
    text = "<en>Hello <zh>你好 世界</zh> again</en>"
    offset = text.index("世界")
    pipeline = UtteranceText("Auto", open_languages=languages_open_at(text, offset))
    segs = pipeline.feed(text[offset:]) + pipeline.flush()
    assert spoken(segs) == [("世界", "Chinese"), (" again", "English")]


def test_auto_rule() -> None:
    assert detect_language("今日は良い天気ですね") == "Japanese"
    assert detect_language("안녕하세요 반갑습니다") == "Korean"
    assert detect_language("我们明天见") == "Chinese"
    assert detect_language("Привет, как дела?") == "Russian"
    assert detect_language("The weather is nice today.") == "English"
    assert detect_language("Der Hund ist nicht groß und die Katze schläft.") == "German"
    assert detect_language("Je ne sais pas, mais c'est très bien avec vous.") == "French"
    assert detect_language("¿Dónde está el baño? Muy bien, gracias.") == "Spanish"
    assert detect_language("Não sei, obrigado.") == "Portuguese"
    assert detect_language("Ciao, grazie per questo.") == "Italian"
    assert detect_language("OK iPhone 请帮我") == "Chinese"
    assert detect_language("OK iPhone 请") == "English"
    assert detect_language("12345 — 67.") is None


def test_auto_keeps_the_previous_language_for_a_segment_without_letters() -> None:
    segs = segments("你好。 123. ", clause_min_chars=1)
    assert [s.language for s in segs] == ["Chinese", "Chinese"]


def test_normalise_language() -> None:
    assert normalise_language(None) == "Auto"
    assert normalise_language("auto") == "Auto"
    assert normalise_language("en-US") == "English"
    assert normalise_language("zh") == "Chinese"
    assert normalise_language("Chinese") == "Chinese"
    assert normalise_language("Klingon") == "Klingon"


def test_long_tagged_text_is_cut_within_max_chars_and_never_across_languages() -> None:
    text = "<zh>" + "这是一个很长的句子没有标点" * 40 + "</zh>" + "<en>" + "word " * 100 + "</en>"
    segs = segments(text, step=7, max_chars=50)
    assert all(len(s.text) <= 50 for s in segs)
    assert {s.language for s in segs} == {"Chinese", "English"}
    check_offsets(text, segs)
    chinese = [s for s in segs if s.language == "Chinese"]
    assert "".join(s.text for s in chinese) == "这是一个很长的句子没有标点" * 40


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(
        st.sampled_from(
            [
                "Hi ",
                "你好",
                "。",
                ". ",
                ", ",
                "<zh>",
                "</zh>",
                "<en>",
                "</en>",
                "<",
                ">",
                "<e",
                "3.14",
                " ",
                "\n",
                "ok!",
            ]
        ),
        max_size=40,
    ),
    st.integers(1, 6),
)
def test_any_tagged_text_maps_back_to_the_client_text(pieces: list[str], step: int) -> None:
    text = "".join(pieces)
    segs = segments(text, step=step, max_chars=20, clause_min_chars=5)
    check_offsets(text, segs)
    starts = [s.source_offset(0) for s in segs]
    assert starts == sorted(starts)
    assert all(len(s.text) <= 20 for s in segs)
    whole = segments(text, max_chars=20, clause_min_chars=5)
    assert [(s.text.strip(), s.language) for s in segs] == [(s.text.strip(), s.language) for s in whole]
