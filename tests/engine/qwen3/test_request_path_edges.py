"""Edges of the Qwen3 engine's host-side request path (tiny random models, CPU): a request whose
prompt cannot be built or does not fit ends alone, with the typed error the client's protocol
code comes from (`invalid_request`, never `internal`), and the streams beside it speak on."""

from __future__ import annotations

import pytest

from engine.api import InvalidRequest, SynthesisRequest, TextSegment
from engine.qwen3.engine import Qwen3Engine
from engine.qwen3.request import RequestStatus
from gateway.errors import error_code
from tests.engine.qwen3.test_qwen3_engine import bundle, checkpoint, collect, drive, make_engine, open_greedy  # noqa: F401
from tests.engine.qwen3.test_voice_clone import clip
from tests.engine.qwen3.utils import tiny_base_engine

pytestmark = pytest.mark.reference
LONE_SURROGATE = "Hello \ud800 there."  # what json.loads makes of a "\ud800" escape


@pytest.fixture(scope="module")
def base_engine(tmp_path_factory: pytest.TempPathFactory) -> Qwen3Engine:
    return tiny_base_engine(tmp_path_factory.mktemp("tiny_base_edges"))


async def fails_with(stream) -> BaseException:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception) as info:
        await collect(stream)
    return info.value


async def speaks_in_full(stream, state, frames: int) -> None:  # type: ignore[no-untyped-def]
    assert state.status == RequestStatus.FINISHED_STOPPED and state.frames_generated == frames
    assert (await collect(stream))[-1].final


async def test_a_prompt_past_max_len_ends_its_own_request_as_an_invalid_request(bundle) -> None:  # noqa: F811
    engine = make_engine(bundle)  # max_len 128
    long = engine.open(
        SynthesisRequest(
            request_id="long",
            voice="ryan",
            language="English",
            instructions="Speak slowly, warmly and with a smile in the voice. " * 8,
            greedy=True,
            max_frames=3,
        )
    )
    long_state = engine.scheduler.requests["long"]
    long.push(TextSegment("Hello there.", char_start=0))
    long.close_text()
    short, short_state = open_greedy(engine, "short", "Hi there.", 3)
    drive(engine)
    assert long_state.status == RequestStatus.FINISHED_ERROR
    exc = await fails_with(long)
    assert isinstance(exc, InvalidRequest) and error_code(exc) == "invalid_request"
    assert "exceeds max_len 128" in str(exc) and not str(exc).startswith("InvalidRequest")
    await speaks_in_full(short, short_state, 3)


async def test_segment_text_past_the_text_positions_is_an_invalid_request(bundle) -> None:  # noqa: F811
    engine = make_engine(bundle, max_trailing=8)
    long, long_state = open_greedy(
        engine, "long", "This sentence has far too many words for eight positions.", 3
    )
    short, short_state = open_greedy(engine, "short", "Hi there.", 3)
    drive(engine)
    assert long_state.status == RequestStatus.FINISHED_ERROR
    exc = await fails_with(long)
    assert isinstance(exc, InvalidRequest) and "segment text too long" in str(exc)
    await speaks_in_full(short, short_state, 3)


def test_the_tokenizer_refuses_text_that_is_not_valid_unicode_as_a_value_error(bundle) -> None:  # noqa: F811
    b, _ = bundle
    with pytest.raises(ValueError, match="not valid Unicode"):
        b.tokenizer.encode(LONE_SURROGATE)
    assert b.tokenizer.encode("\u200b\U0001f600e\u0301")  # unusual but valid text still tokenises


@pytest.mark.parametrize("where", ["text", "instructions"])
async def test_a_lone_surrogate_in_text_or_instructions_is_an_invalid_request_at_push(bundle, where) -> None:  # noqa: F811
    engine = make_engine(bundle)
    bad = engine.open(
        SynthesisRequest(
            request_id="bad",
            voice="ryan",
            language="English",
            instructions=LONE_SURROGATE if where == "instructions" else None,
            greedy=True,
            max_frames=3,
        )
    )
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        bad.push(TextSegment(LONE_SURROGATE if where == "text" else "Hello there.", char_start=0))
    bad.cancel()  # what the gateway does with a stream whose push failed
    good, good_state = open_greedy(engine, "good", "Hi there.", 3)
    drive(engine)
    await speaks_in_full(good, good_state, 3)


@pytest.mark.parametrize(
    ("segment", "message"),
    [
        (TextSegment("Hello there.", char_start=0, language="Klingon"), "unsupported language 'Klingon'"),
        (TextSegment(LONE_SURROGATE, char_start=0), "not valid Unicode"),
    ],
    ids=["language", "surrogate"],
)
async def test_a_one_off_clones_unusable_segment_fails_alone_on_the_step_thread(
    base_engine: Qwen3Engine, segment: TextSegment, message: str
) -> None:
    """A one-off clip's segments are tokenised on the step thread, once the clip's prompt is known:
    the refusal still reaches the client as an invalid request, and the step thread serves on."""
    engine = base_engine
    audio = clip()
    bad = engine.open(
        SynthesisRequest(
            request_id=f"bad-{message[:4]}",
            language="English",
            greedy=True,
            max_frames=2,
            ref_audio=(audio, 16000),
            ref_text="A short reference sentence.",
        )
    )
    bad.push(segment)  # nothing to check before the clip's prompt exists
    bad.close_text()
    good = engine.open(
        SynthesisRequest(
            request_id=f"good-{message[:4]}",
            language="English",
            greedy=True,
            max_frames=2,
            ref_audio=(audio, 16000),
            ref_text="A short reference sentence.",
        )
    )
    good_state = engine.scheduler.requests[good.request_id]
    good.push(TextSegment("Hello there.", char_start=0))
    good.close_text()
    drive(engine)
    exc = await fails_with(bad)
    assert isinstance(exc, InvalidRequest) and message in str(exc), exc
    await speaks_in_full(good, good_state, 2)
    assert not engine._pending_prompts
