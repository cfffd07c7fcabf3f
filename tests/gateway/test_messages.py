"""The wire schema: decoding client frames into typed messages, and the packet header."""

from __future__ import annotations

import json

import pytest

from gateway.messages import (
    HEADER_BYTES,
    OutputRequest,
    PacketHeader,
    PlaybackReport,
    ProtocolError,
    SessionEnd,
    SessionStart,
    SpeakAppend,
    SpeakCancel,
    SpeakEnd,
    SpeakFlush,
    SpeakPause,
    SpeakResume,
    SpeakUnpause,
    decode,
    encode_client,
    unpack_packet,
    validate_output,
)


def error_of(frame: str | bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    return info.value


def test_session_start_with_every_field() -> None:
    msg = decode(
        json.dumps(
            {
                "type": "session.start",
                "voice": "Vivian",
                "language": "English",
                "instructions": "calm",
                "output": {"encoding": "mulaw", "sample_rate": 8000, "packet_ms": 20},
                "timestamps": "none",
                "pacing": "realtime",
                "extra": [1, 2],
            }
        )
    )
    assert msg == SessionStart(
        voice="Vivian",
        language="English",
        instructions="calm",
        output=OutputRequest("mulaw", 8000, 20),
        timestamps="none",
        pacing="realtime",
    )


def test_session_start_defaults() -> None:
    assert decode('{"type": "session.start"}') == SessionStart()


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        ({"type": "speak.append", "utterance_id": "u1", "text": "Hi "}, SpeakAppend("u1", "Hi ", False)),
        (
            {"type": "speak.append", "utterance_id": "u1", "text": "", "flush": True},
            SpeakAppend("u1", "", True),
        ),
        ({"type": "speak.flush", "utterance_id": "u1"}, SpeakFlush("u1")),
        ({"type": "speak.end", "utterance_id": "u1"}, SpeakEnd("u1")),
        ({"type": "speak.cancel"}, SpeakCancel(None, None)),
        ({"type": "speak.cancel", "utterance_id": "u1", "played_ms": 960.7}, SpeakCancel("u1", 960)),
        ({"type": "speak.resume", "utterance_id": "u2", "from_utterance": "u1"}, SpeakResume("u2", "u1")),
        ({"type": "playback.report", "utterance_id": "u1", "played_ms": 400}, PlaybackReport("u1", 400)),
        ({"type": "speak.pause"}, SpeakPause(None, None)),
        ({"type": "speak.pause", "utterance_id": "u1", "played_ms": 960}, SpeakPause("u1", 960)),
        ({"type": "speak.unpause"}, SpeakUnpause(None)),
        ({"type": "speak.unpause", "utterance_id": "u1"}, SpeakUnpause("u1")),
        ({"type": "session.start", "pause_timeout_ms": 2000}, SessionStart(pause_timeout_ms=2000)),
        ({"type": "session.end"}, SessionEnd()),
    ],
)
def test_each_client_message_decodes(frame: dict[str, object], expected: object) -> None:
    assert decode(json.dumps(frame)) == expected


def test_encode_client_round_trips() -> None:
    for msg in (
        SpeakAppend("u1", "héllo", True),
        SpeakCancel("u1", 5),
        SessionStart(voice="v"),
        SpeakCancel(),
        PlaybackReport("a", 1),
        SpeakPause("u1", 20),
        SpeakUnpause(),
        SessionStart(pause_timeout_ms=1500),
    ):
        assert decode(encode_client(msg)) == msg


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("not json", "invalid_message"),
        ("[1, 2]", "invalid_message"),
        ('"text"', "invalid_message"),
        ("{}", "invalid_message"),
        ('{"type": 7}', "invalid_message"),
        ('{"type": "speak.sing"}', "unknown_type"),
        ('{"type": "speak.append", "text": "x"}', "invalid_message"),
        ('{"type": "speak.append", "utterance_id": "", "text": "x"}', "invalid_message"),
        ('{"type": "speak.append", "utterance_id": 5, "text": "x"}', "invalid_message"),
        ('{"type": "speak.append", "utterance_id": "u", "text": 5}', "invalid_message"),
        ('{"type": "speak.append", "utterance_id": "u"}', "invalid_message"),
        ('{"type": "speak.append", "utterance_id": "u", "text": "x", "flush": "yes"}', "invalid_message"),
        ('{"type": "speak.append", "utterance_id": "u", "text": "\\ud800"}', "invalid_message"),
        ('{"type": "speak.cancel", "played_ms": -1}', "invalid_message"),
        ('{"type": "speak.cancel", "played_ms": true}', "invalid_message"),
        ('{"type": "speak.cancel", "played_ms": "10"}', "invalid_message"),
        ('{"type": "playback.report", "utterance_id": "u"}', "invalid_message"),
        ('{"type": "speak.pause", "played_ms": -5}', "invalid_message"),
        ('{"type": "speak.unpause", "utterance_id": 3}', "invalid_message"),
        ('{"type": "session.start", "pause_timeout_ms": 0}', "invalid_message"),
        ('{"type": "session.start", "pause_timeout_ms": 600001}', "invalid_message"),
        ('{"type": "speak.resume", "utterance_id": "u2"}', "invalid_message"),
        ('{"type": "session.start", "output": "pcm"}', "invalid_message"),
        ('{"type": "session.start", "output": {"encoding": "opus"}}', "unsupported_output"),
        ('{"type": "session.start", "output": {"sample_rate": 11025}}', "unsupported_output"),
        ('{"type": "session.start", "output": {"packet_ms": 7}}', "unsupported_output"),
        ('{"type": "session.start", "timestamps": "char"}', "invalid_message"),
        ('{"type": "session.start", "pacing": "slow"}', "invalid_message"),
        (b"\xff\xfe{", "invalid_message"),
    ],
)
def test_bad_frames_raise_typed_errors(frame: str | bytes, code: str) -> None:
    assert error_of(frame).code == code


def test_error_carries_the_utterance_id_when_known() -> None:
    err = error_of('{"type": "speak.append", "utterance_id": "u9", "text": 3}')
    assert err.utterance_id == "u9"
    assert "text" in err.message


def test_overlong_id_is_refused() -> None:
    assert error_of(json.dumps({"type": "speak.end", "utterance_id": "x" * 129})).code == "invalid_message"


def test_utf8_bytes_frame_decodes() -> None:
    assert decode('{"type":"speak.append","utterance_id":"u","text":"你好"}'.encode()) == SpeakAppend(
        "u", "你好"
    )


@pytest.mark.parametrize(
    ("encoding", "rate", "ok"),
    [
        ("pcm_s16le", 24000, True),
        ("pcm_f32le", 48000, True),
        ("mulaw", 8000, True),
        ("alaw", 8000, True),
        ("mulaw", 16000, False),
        ("alaw", 24000, False),
        ("pcm_s16le", 12345, False),
        ("mp3", 24000, False),
    ],
)
def test_validate_output(encoding: str, rate: int, ok: bool) -> None:
    if ok:
        validate_output(encoding, rate, 20)
    else:
        with pytest.raises(ProtocolError) as info:
            validate_output(encoding, rate, 20)
        assert info.value.code == "unsupported_output"


def test_packet_header_layout_is_little_endian_12_bytes() -> None:
    header = PacketHeader(stream=0x0102, seq=0x03040506, sample_offset=0x0708090A, flags=1)
    raw = header.pack()
    assert len(raw) == HEADER_BYTES == 12
    assert raw == bytes([1, 1, 0x02, 0x01, 0x06, 0x05, 0x04, 0x03, 0x0A, 0x09, 0x08, 0x07])
    parsed, payload = unpack_packet(raw + b"abc")
    assert parsed == header and parsed.last and payload == b"abc"


def test_short_packet_is_rejected() -> None:
    with pytest.raises(ValueError):
        unpack_packet(b"\x01\x00")


def test_max_wait_ms_on_the_first_append() -> None:
    message = decode('{"type":"speak.append","utterance_id":"u","text":"hi","max_wait_ms":250}')
    assert isinstance(message, SpeakAppend) and message.max_wait_ms == 250
    assert (
        encode_client(message)
        == '{"type":"speak.append","utterance_id":"u","text":"hi","flush":false,"max_wait_ms":250}'
    )
    for bad in ('"soon"', "-5", "true"):
        with pytest.raises(ProtocolError) as refused:
            decode(
                json.dumps({"type": "speak.append", "utterance_id": "u", "text": "hi"})[:-1]
                + f',"max_wait_ms":{bad}}}'
            )
        assert refused.value.code == "invalid_message"
