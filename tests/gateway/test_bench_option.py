"""The benchmark's forced length travels from speak.append to the engine request."""

from __future__ import annotations

import json

import pytest

from gateway.messages import ProtocolError, SpeakAppend, decode
from tests.gateway.test_protocol import Harness


def append(**extra: object) -> str:
    return json.dumps({"type": "speak.append", "utterance_id": "u1", "text": "Hi.", **extra})


def test_forced_frames_is_decoded_from_the_bench_object() -> None:
    message = decode(append(bench={"forced_frames": 93}))
    assert isinstance(message, SpeakAppend) and message.forced_frames == 93
    assert decode(append()).forced_frames is None  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [0, -3, 9000, 2.5, True, "12", None])
def test_bad_forced_frames_are_typed_errors(bad: object) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(append(bench={"forced_frames": bad}))
    assert info.value.code == "invalid_message"


def test_the_engine_request_carries_the_forced_length() -> None:
    h = Harness()
    h.send(type="speak.append", utterance_id="u1", text="Hi.", bench={"forced_frames": 40})
    assert h.requests["u1"].forced_frames == 40
