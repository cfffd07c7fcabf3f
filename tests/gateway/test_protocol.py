"""The sans-I/O session state machine: frames and engine chunks in, actions out. No sockets."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from engine.api import (
    AudioChunk,
    EngineInfo,
    Overloaded,
    QueuePosition,
    TextSegment,
    UnknownVoice,
    WordTiming,
)
from gateway.config import GatewayConfig
from gateway.messages import unpack_packet
from gateway.packets import Packet
from gateway.protocol import (
    Action,
    CancelStream,
    Close,
    CloseText,
    OpenStream,
    Purge,
    PushText,
    SendAudio,
    SendControl,
    SendTrailer,
    SessionProtocol,
    Status,
)


class Harness:
    """Plays the session's part: runs actions, records what would go on the wire."""

    def __init__(self, config: GatewayConfig | None = None, rate: int = 24000) -> None:
        self.info = EngineInfo("fake", "tones", rate, voices=("alice",))
        self.p = SessionProtocol("s1", self.info, config or GatewayConfig())
        self.now = 0.0
        self.control: list[dict[str, Any]] = []
        self.audio: list[tuple[int, Packet | dict[str, Any]]] = []  # the queued audio lane
        self.wire: list[Any] = []  # what was sent, in order
        self.requests: dict[str, Any] = {}
        self.pushed: dict[str, list[TextSegment]] = {}
        self.text_closed: set[str] = set()
        self.cancelled: list[str] = []
        self.closes: list[Close] = []
        self.refuse: dict[str, Exception] = {}
        self.queued: dict[str, QueuePosition] = {}  # opens the engine queues
        self.actions: list[Action] = []
        self.offsets: dict[str, int] = {}

    def run(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            self.actions.append(a)
            if isinstance(a, SendControl):
                self.control.append(dict(a.message))
                self.wire.append(dict(a.message))
            elif isinstance(a, SendAudio):
                self.audio += [(a.stream, packet) for packet in a.packets]
            elif isinstance(a, SendTrailer):
                self.audio.append((a.stream, dict(a.message)))
            elif isinstance(a, Purge):
                self.audio = [x for x in self.audio if x[0] != a.stream]
            elif isinstance(a, OpenStream):
                self.requests[a.utterance_id] = a.request
                if a.utterance_id in self.refuse:
                    self.run(self.p.open_failed(a.utterance_id, self.refuse[a.utterance_id]))
                else:
                    self.run(self.p.open_succeeded(a.utterance_id, self.queued.get(a.utterance_id)))
            elif isinstance(a, PushText):
                self.pushed.setdefault(a.utterance_id, []).append(a.segment)
            elif isinstance(a, CloseText):
                self.text_closed.add(a.utterance_id)
            elif isinstance(a, CancelStream):
                self.cancelled.append(a.utterance_id)
            elif isinstance(a, Close):
                self.closes.append(a)
        return actions

    def send(self, **message: Any) -> list[Action]:
        return self.run(self.p.receive_text(json.dumps(message), self.now))

    def say(self, uid: str, text: str, end: bool = True) -> None:
        self.send(type="speak.append", utterance_id=uid, text=text)
        if end:
            self.send(type="speak.end", utterance_id=uid)

    def speak_words(self, uid: str, words: list[str], ms_each: int = 100, final: bool = True) -> list[Action]:
        """Engine side: one chunk per word of `ms_each` ms, words timed, char offsets into the text."""
        rate = self.info.sample_rate
        utt = self.p.utterance(uid)
        assert utt is not None
        out: list[Action] = []
        search_from = 0
        for word in words:
            start = self.offsets.get(uid, 0)
            n = rate * ms_each // 1000
            c0 = utt.text.index(word, search_from)
            search_from = c0 + len(word)
            timing = WordTiming(word, start, start + n, c0, c0 + len(word))
            chunk = AudioChunk(uid, np.full(n, 0.1, np.float32), start, (timing,))
            out += self.run(self.p.receive_chunk(uid, chunk))
            self.offsets[uid] = start + n
        if final:
            end = AudioChunk(uid, np.zeros(0, np.float32), self.offsets.get(uid, 0), (), final=True)
            out += self.run(self.p.receive_chunk(uid, end))
        return out

    def deliver(self, count: int | None = None, seconds_per_packet: float = 0.0) -> None:
        """The writer sends `count` audio-lane items (all when None)."""
        n = len(self.audio) if count is None else count
        for _ in range(n):
            stream, item = self.audio.pop(0)
            self.wire.append(item)
            if isinstance(item, Packet):
                self.run(self.p.packet_sent(stream, item, self.now))
                self.now += seconds_per_packet
            else:
                self.run(self.p.trailer_sent(stream))

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.control if m["type"] == kind]

    def errors(self) -> list[tuple[str, str | None]]:
        return [(m["code"], m.get("utterance_id")) for m in self.of_type("error")]


# -- session start ---------------------------------------------------------------------------


def test_first_speak_starts_the_session_with_defaults() -> None:
    h = Harness()
    h.say("u1", "Hello.")
    started = h.control[0]
    assert started["type"] == "session.started" and started["session_id"] == "s1"
    assert started["output"] == {
        "encoding": "pcm_s16le",
        "sample_rate": 24000,
        "packet_ms": 20,
        "samples_per_packet": 480,
    }
    assert started["engine"] == {"name": "fake", "model": "tones"}
    assert h.control[1] == {"type": "utterance.started", "utterance_id": "u1", "stream": 1}


def test_session_start_sets_output_and_request_fields() -> None:
    h = Harness()
    h.send(
        type="session.start",
        voice="alice",
        language="English",
        instructions="calm",
        output={"encoding": "pcm_f32le", "sample_rate": 16000, "packet_ms": 40},
    )
    assert h.control[0]["output"] == {
        "encoding": "pcm_f32le",
        "sample_rate": 16000,
        "packet_ms": 40,
        "samples_per_packet": 640,
    }
    h.say("u1", "Hi.")
    request = h.requests["u1"]
    assert (request.voice, request.language, request.instructions) == ("alice", "English", "calm")
    assert request.request_id == "s1/u1"


def test_the_request_says_where_its_words_come_from() -> None:
    """Known at open, so an engine with a forced aligner counts only the streams that want its
    words towards the aligner's share."""
    for start, expected in (
        ({}, "async"),
        ({"alignment": "sync"}, "sync"),
        ({"timestamps": "none"}, "off"),
        ({"timestamps": "none", "alignment": "sync"}, "off"),
    ):
        h = Harness()
        h.send(type="session.start", **start)
        h.say("u1", "Hi.")
        assert h.requests["u1"].word_alignment == expected, start


def test_mulaw_defaults_to_8k() -> None:
    h = Harness()
    h.send(type="session.start", output={"encoding": "mulaw"})
    assert h.control[0]["output"]["sample_rate"] == 8000
    assert h.control[0]["output"]["samples_per_packet"] == 160


def test_mulaw_at_16k_is_refused_and_session_stays_unstarted() -> None:
    h = Harness()
    h.send(type="session.start", output={"encoding": "mulaw", "sample_rate": 16000})
    assert h.errors() == [("unsupported_output", None)]
    assert not h.p.started
    h.send(type="session.start", output={"encoding": "alaw"})
    assert h.of_type("session.started")[0]["output"]["encoding"] == "alaw"


def test_second_session_start_is_an_error() -> None:
    h = Harness()
    h.send(type="session.start")
    h.send(type="session.start", voice="bob")
    assert h.errors() == [("session_started", None)]
    assert h.p.voice is None


def test_session_start_after_speak_is_an_error() -> None:
    h = Harness()
    h.say("u1", "Hi.", end=False)
    h.send(type="session.start")
    assert h.errors() == [("session_started", None)]


# -- text ------------------------------------------------------------------------------------


def test_append_pushes_complete_segments_and_end_flushes_the_rest() -> None:
    h = Harness()
    h.send(type="speak.append", utterance_id="u1", text="Sure, I can ")
    assert "u1" not in h.pushed
    h.send(type="speak.append", utterance_id="u1", text="help. With ")
    assert [s.text for s in h.pushed["u1"]] == ["Sure, I can help. "]
    h.send(type="speak.append", utterance_id="u1", text="that")
    h.send(type="speak.end", utterance_id="u1")
    assert [(s.text, s.char_start) for s in h.pushed["u1"]] == [("Sure, I can help. ", 0), ("With that", 18)]
    assert h.text_closed == {"u1"}
    assert h.p.utterance("u1").status is Status.TEXT_CLOSED  # type: ignore[union-attr]


def test_flush_pushes_pending_text_and_keeps_the_utterance_open() -> None:
    h = Harness()
    h.send(type="speak.append", utterance_id="u1", text="no boundary here")
    h.send(type="speak.flush", utterance_id="u1")
    assert [s.text for s in h.pushed["u1"]] == ["no boundary here"]
    h.send(type="speak.append", utterance_id="u1", text=" more", flush=True)
    assert [(s.text, s.char_start) for s in h.pushed["u1"]] == [("no boundary here", 0), (" more", 16)]
    assert h.text_closed == set()


def test_append_after_end_is_utterance_closed() -> None:
    h = Harness()
    h.say("u1", "Hi.")
    h.send(type="speak.append", utterance_id="u1", text="more")
    assert h.errors() == [("utterance_closed", "u1")]


def test_second_end_is_harmless() -> None:
    h = Harness()
    h.say("u1", "Hi.")
    h.send(type="speak.end", utterance_id="u1")
    assert h.errors() == []


@pytest.mark.parametrize("kind", ["speak.flush", "speak.end"])
def test_flush_or_end_of_unknown_utterance(kind: str) -> None:
    h = Harness()
    h.send(type=kind, utterance_id="nope")
    assert h.errors() == [("unknown_utterance", "nope")]


def test_text_too_long_rejects_the_append_only() -> None:
    h = Harness(GatewayConfig(max_text_chars=20))
    h.send(type="speak.append", utterance_id="u1", text="0123456789")
    h.send(type="speak.append", utterance_id="u1", text="0123456789ABC")
    assert h.errors() == [("text_too_long", "u1")]
    h.send(type="speak.append", utterance_id="u1", text="ok", flush=True)
    assert h.p.utterance("u1").text == "0123456789ok"  # type: ignore[union-attr]
    h.send(type="speak.append", utterance_id="u2", text="x" * 21)
    assert h.errors()[-1] == ("text_too_long", "u2")
    assert h.p.utterance("u2") is None


def test_too_many_open_utterances() -> None:
    h = Harness(GatewayConfig(max_open_utterances=2))
    h.say("a", "A.", end=False)
    h.say("b", "B.", end=False)
    h.say("c", "C.", end=False)
    assert h.errors() == [("too_many_utterances", "c")]
    assert set(h.requests) == {"a", "b"}


# -- engine admission ------------------------------------------------------------------------


def test_overloaded_open_is_an_error_and_the_id_can_be_retried() -> None:
    h = Harness()
    h.refuse["u1"] = Overloaded("busy")
    h.say("u1", "Hello.", end=False)
    assert h.errors() == [("overloaded", "u1")]
    assert h.of_type("utterance.started") == []
    assert h.p.active_count == 0
    del h.refuse["u1"]
    h.say("u1", "Hello.")
    assert h.of_type("utterance.started")[0]["utterance_id"] == "u1"


def test_a_queued_open_is_announced_after_started_and_an_overload_says_when_to_retry() -> None:
    h = Harness()
    h.queued["u1"] = QueuePosition(3, 1.25)
    h.say("u1", "Hello.")
    started, queued = h.of_type("utterance.started")[0], h.of_type("utterance.queued")[0]
    assert queued == {
        "type": "utterance.queued",
        "utterance_id": "u1",
        "position": 3,
        "expected_wait_ms": 1250,
    }
    assert h.control.index(started) < h.control.index(queued)
    h.refuse["u2"] = Overloaded("busy", retry_after_s=2.4)
    h.say("u2", "Hi.", end=False)
    (error,) = [m for m in h.of_type("error") if m.get("utterance_id") == "u2"]
    assert error["code"] == "overloaded" and error["retry_after_ms"] == 2400
    h.refuse["u3"] = UnknownVoice("no such voice")
    h.say("u3", "Hi.", end=False)
    assert "retry_after_ms" not in [m for m in h.of_type("error") if m.get("utterance_id") == "u3"][0]


def test_max_wait_ms_reaches_the_engine_request() -> None:
    h = Harness()
    h.send(type="speak.append", utterance_id="u1", text="Hi.", max_wait_ms=1500)
    h.send(type="speak.append", utterance_id="u2", text="Hi.")
    assert h.requests["u1"].max_wait_s == 1.5 and h.requests["u2"].max_wait_s is None
    h.send(type="speak.append", utterance_id="u3", text="Hi.", max_wait_ms=-1)
    assert h.errors()[-1] == ("invalid_message", "u3")


def test_an_overload_mid_stream_says_when_to_retry() -> None:
    h = Harness()
    h.say("u1", "Hello.")
    h.run(h.p.stream_failed("u1", Overloaded("still queued when max_wait_ms passed", retry_after_s=0.5)))
    (error,) = h.of_type("error")
    assert error["code"] == "overloaded" and error["retry_after_ms"] == 500


def test_unknown_voice_open() -> None:
    h = Harness()
    h.refuse["u1"] = UnknownVoice("no such voice")
    h.say("u1", "Hello.")
    assert h.errors()[0] == ("unknown_voice", "u1")
    assert "unknown_utterance" in [c for c, _ in h.errors()]  # the speak.end that followed


def test_internal_error_message_is_not_leaked() -> None:
    h = Harness()
    h.refuse["u1"] = RuntimeError("secret stack detail")
    h.say("u1", "Hi.", end=False)
    error = h.of_type("error")[0]
    assert error["code"] == "internal" and "secret" not in error["message"]


# -- audio and words -------------------------------------------------------------------------


def test_words_come_before_the_packets_they_describe() -> None:
    h = Harness()
    h.say("u1", "Hello world.")
    actions = h.speak_words("u1", ["Hello", "world."], ms_each=100)
    kinds = [type(a).__name__ for a in actions]
    assert kinds[0] == "SendControl" and kinds[1] == "SendAudio"
    words = h.of_type("words")
    assert [w["words"][0] for w in words] == [
        {"index": 0, "text": "Hello", "start_ms": 0, "end_ms": 100, "char_start": 0, "char_end": 5},
        {"index": 1, "text": "world.", "start_ms": 100, "end_ms": 200, "char_start": 6, "char_end": 12},
    ]
    assert words[0]["source"] == "engine"


def test_engine_samples_convert_to_ms_at_the_engine_rate() -> None:
    h = Harness(rate=16000)
    h.say("u1", "one two")
    h.speak_words("u1", ["one", "two"], ms_each=250)
    assert [w["words"][0]["end_ms"] for w in h.of_type("words")] == [250, 500]
    done = [x for _, x in h.audio if isinstance(x, dict)][0]
    assert done["duration_ms"] == 500


def test_packets_and_done() -> None:
    h = Harness()
    h.say("u1", "a b c")
    h.speak_words("u1", ["a", "b", "c"], ms_each=30)  # 90 ms -> 4 full packets + 10 ms
    packets = [x for _, x in h.audio if isinstance(x, Packet)]
    assert [p.header.seq for p in packets] == [0, 1, 2, 3, 4]
    assert [p.samples for p in packets] == [480, 480, 480, 480, 240]
    assert packets[-1].last and not any(p.last for p in packets[:-1])
    trailer = h.audio[-1][1]
    assert trailer == {"type": "utterance.done", "utterance_id": "u1", "duration_ms": 90, "packets": 5}
    assert h.p.utterance("u1").status is Status.GENERATED  # type: ignore[union-attr]
    h.deliver(len(h.audio) - 1)
    assert h.p.utterance("u1").status is Status.GENERATED  # type: ignore[union-attr]
    h.deliver()
    assert h.p.utterance("u1").status is Status.DELIVERED  # type: ignore[union-attr]
    assert h.p.active_count == 0


def test_output_rate_conversion_in_packets() -> None:
    h = Harness()
    h.send(type="session.start", output={"sample_rate": 16000})
    h.say("u1", "a")
    h.speak_words("u1", ["a"], ms_each=1000)
    packets = [x for _, x in h.audio if isinstance(x, Packet)]
    assert all(p.samples == 320 for p in packets[:-1])
    assert abs(sum(p.samples for p in packets) - 16000) <= 2


def test_timestamps_none_sends_no_words_but_barge_in_still_finds_them() -> None:
    h = Harness()
    h.send(type="session.start", timestamps="none")
    h.say("u1", "one two three")
    h.speak_words("u1", ["one", "two", "three"], ms_each=100, final=False)
    assert h.of_type("words") == []
    h.deliver()
    h.send(type="speak.cancel", utterance_id="u1", played_ms=150)
    interrupted = h.of_type("utterance.interrupted")[0]
    assert interrupted["last_word"]["text"] == "one" and interrupted["partial_word"]["text"] == "two"


def test_a_gap_in_engine_offsets_is_filled_with_silence() -> None:
    h = Harness()
    h.say("u1", "x")
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", np.ones(480, np.float32) * 0.5, 0)))
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", np.ones(480, np.float32) * 0.5, 960, final=True)))
    packets = [x for _, x in h.audio if isinstance(x, Packet)]
    middle = np.frombuffer(packets[1].payload, "<i2")
    assert packets[1].header.sample_offset == 480 and not middle.any()
    assert packets[2].header.sample_offset == 960


def test_an_overlapping_chunk_is_trimmed() -> None:
    h = Harness()
    h.say("u1", "x")
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", np.ones(480, np.float32), 0)))
    h.run(h.p.receive_chunk("u1", AudioChunk("u1", np.ones(480, np.float32), 240, final=True)))
    assert h.p.utterance("u1").engine_samples == 720  # type: ignore[union-attr]


def test_stream_ended_without_final_still_finishes() -> None:
    h = Harness()
    h.say("u1", "a")
    h.speak_words("u1", ["a"], final=False)
    h.run(h.p.stream_ended("u1"))
    assert isinstance(h.audio[-1][1], dict) and h.audio[-1][1]["type"] == "utterance.done"
    assert any(isinstance(x, Packet) and x.last for _, x in h.audio)


def test_engine_failure_ends_only_that_utterance() -> None:
    h = Harness()
    h.say("u1", "a b")
    h.say("u2", "c d")
    h.speak_words("u1", ["a"], final=False)
    h.speak_words("u2", ["c"], final=False)
    h.run(h.p.stream_failed("u1", RuntimeError("boom")))
    assert h.errors() == [("internal", "u1")]
    assert all(stream != 1 for stream, _ in h.audio)  # u1's queued audio was purged
    assert h.p.utterance("u1").status is Status.FAILED  # type: ignore[union-attr]
    h.speak_words("u2", ["d"])
    assert h.p.utterance("u2").status is Status.GENERATED  # type: ignore[union-attr]


def test_two_utterances_get_distinct_streams_and_interleave() -> None:
    h = Harness()
    h.say("a", "one two")
    h.say("b", "three four")
    h.speak_words("a", ["one"], final=False)
    h.speak_words("b", ["three"], final=False)
    h.speak_words("a", ["two"])
    h.speak_words("b", ["four"])
    streams = [s for s, x in h.audio if isinstance(x, Packet)]
    assert set(streams) == {1, 2}
    assert streams.index(2) < len(streams) - 1 - streams[::-1].index(1)  # interleaved
    for stream in (1, 2):
        seqs = [x.header.seq for s, x in h.audio if s == stream and isinstance(x, Packet)]
        assert seqs == list(range(len(seqs)))


def test_stream_handles_are_not_reused() -> None:
    h = Harness(GatewayConfig(max_open_utterances=1))
    for i in range(5):
        h.say(f"u{i}", "a")
        h.speak_words(f"u{i}", ["a"])
        h.deliver()
    assert [m["stream"] for m in h.of_type("utterance.started")] == [1, 2, 3, 4, 5]


# -- barge-in --------------------------------------------------------------------------------

WORDS = ["Sure,", "I", "can", "help", "you", "with", "that."]


def spoken(h: Harness, uid: str = "u1", deliver_packets: int | None = None) -> None:
    h.say(uid, "Sure, I can help you with that.")
    h.speak_words(uid, WORDS, ms_each=200, final=False)
    if deliver_packets:
        h.deliver(deliver_packets, seconds_per_packet=0.02)


def test_cancel_fences_the_stream() -> None:
    h = Harness()
    spoken(h, deliver_packets=10)
    actions = h.send(type="speak.cancel", utterance_id="u1", played_ms=150)
    assert [type(a).__name__ for a in actions] == ["CancelStream", "Purge", "SendControl"]
    assert h.audio == []
    assert h.cancelled == ["u1"]
    late = AudioChunk("u1", np.ones(960, np.float32), 1400, final=True)
    assert h.p.receive_chunk("u1", late) == []
    assert h.p.stream_ended("u1") == []


def test_cancel_with_client_position() -> None:
    h = Harness()
    spoken(h, deliver_packets=60)  # 1200 ms sent
    h.send(type="speak.cancel", utterance_id="u1", played_ms=700)
    msg = h.of_type("utterance.interrupted")[0]
    assert msg["played_ms"] == 700 and msg["position_source"] == "client"
    assert msg["last_word"] == {
        "index": 2,
        "text": "can",
        "start_ms": 400,
        "end_ms": 600,
        "char_start": 8,
        "char_end": 11,
    }
    assert msg["partial_word"]["text"] == "help"
    assert msg["spoken_text"] == "Sure, I can" and msg["unspoken_text"] == " help you with that."


def test_client_position_is_capped_at_what_was_sent() -> None:
    h = Harness()
    spoken(h, deliver_packets=10)  # 200 ms sent
    h.send(type="speak.cancel", utterance_id="u1", played_ms=5000)
    msg = h.of_type("utterance.interrupted")[0]
    assert msg["played_ms"] == 200 and msg["last_word"]["text"] == "Sure,"


def test_cancel_from_a_playback_report() -> None:
    h = Harness()
    spoken(h, deliver_packets=50)  # 1000 ms sent, clock at 1.0 s
    h.now = 0.5
    h.send(type="playback.report", utterance_id="u1", played_ms=300)
    h.now = 0.75
    h.send(type="speak.cancel", utterance_id="u1")
    msg = h.of_type("utterance.interrupted")[0]
    assert (msg["played_ms"], msg["position_source"]) == (550, "report")
    assert msg["last_word"]["text"] == "I"


def test_cancel_from_the_server_clock() -> None:
    h = Harness()
    spoken(h, deliver_packets=40)  # first packet at t=0, 800 ms sent
    h.now = 0.45
    h.send(type="speak.cancel", utterance_id="u1")
    msg = h.of_type("utterance.interrupted")[0]
    assert (msg["played_ms"], msg["position_source"]) == (450, "server")
    assert msg["last_word"]["text"] == "I" and msg["partial_word"]["text"] == "can"


def test_cancel_before_any_audio_was_sent() -> None:
    h = Harness()
    h.say("u1", "Hello there.")
    h.send(type="speak.cancel", utterance_id="u1")
    msg = h.of_type("utterance.interrupted")[0]
    assert msg["played_ms"] == 0 and msg["last_word"] is None and msg["spoken_text"] == ""
    assert msg["unspoken_text"] == "Hello there."


def test_cancel_is_idempotent() -> None:
    h = Harness()
    spoken(h, deliver_packets=30)
    h.send(type="speak.cancel", utterance_id="u1", played_ms=300)
    h.send(type="speak.cancel", utterance_id="u1", played_ms=900)
    first, second = h.of_type("utterance.interrupted")
    assert first == second and h.cancelled == ["u1"]


def test_cancel_after_delivery_still_answers_with_the_last_word() -> None:
    h = Harness()
    spoken(h)
    h.speak_words("u1", [], final=True)
    h.deliver()
    assert h.p.utterance("u1").status is Status.DELIVERED  # type: ignore[union-attr]
    h.send(type="speak.cancel", utterance_id="u1", played_ms=1000)
    msg = h.of_type("utterance.interrupted")[0]
    assert msg["last_word"]["text"] == "you" and h.cancelled == []


def test_cancel_without_id_cancels_every_active_utterance() -> None:
    h = Harness()
    spoken(h, "a")
    spoken(h, "b")
    h.say("c", "done")
    h.speak_words("c", ["done"])
    h.deliver()
    h.send(type="speak.cancel")
    assert sorted(m["utterance_id"] for m in h.of_type("utterance.interrupted")) == ["a", "b"]
    assert sorted(h.cancelled) == ["a", "b"]


def test_cancel_unknown_utterance() -> None:
    h = Harness()
    h.send(type="speak.cancel", utterance_id="zz")
    assert h.errors() == [("unknown_utterance", "zz")]


def test_cancel_of_an_unopened_utterance_does_not_cancel_the_engine() -> None:
    h = Harness()
    h.refuse["u1"] = Overloaded()
    h.say("u1", "Hi.", end=False)
    h.send(type="speak.cancel", utterance_id="u1")
    assert h.errors()[-1] == ("unknown_utterance", "u1") and h.cancelled == []


def test_report_for_unknown_utterance() -> None:
    h = Harness()
    h.send(type="playback.report", utterance_id="zz", played_ms=10)
    assert h.errors() == [("unknown_utterance", "zz")]


# -- resume ----------------------------------------------------------------------------------


def test_resume_speaks_the_unheard_part_as_a_new_utterance() -> None:
    h = Harness()
    h.send(type="session.start", voice="alice", instructions="calm")
    spoken(h, deliver_packets=60)
    h.send(type="speak.cancel", utterance_id="u1", played_ms=700)
    h.send(type="speak.resume", utterance_id="u2", from_utterance="u1")
    started = h.of_type("utterance.started")[-1]
    assert started == {
        "type": "utterance.started",
        "utterance_id": "u2",
        "stream": 2,
        "resumed_from": "u1",
        "text_offset": 12,
    }
    assert "".join(s.text for s in h.pushed["u2"]) == "help you with that."
    assert h.pushed["u2"][0].char_start == 0
    assert "u2" in h.text_closed
    assert h.requests["u2"].voice == "alice" and h.requests["u2"].instructions == "calm"
    assert h.requests["u2"].request_id == "s1/u2"


def test_resume_errors() -> None:
    h = Harness()
    spoken(h)
    h.send(type="speak.resume", utterance_id="u2", from_utterance="u1")
    h.send(type="speak.resume", utterance_id="u2", from_utterance="nope")
    h.send(type="speak.cancel", utterance_id="u1", played_ms=0)
    h.send(type="speak.resume", utterance_id="u1", from_utterance="u1")
    assert h.errors() == [("not_interrupted", "u2"), ("unknown_utterance", "u2"), ("utterance_exists", "u1")]


# -- session end, limits, bad input ----------------------------------------------------------


def test_session_end_drains_then_ends() -> None:
    h = Harness()
    h.say("u1", "a b", end=False)
    h.send(type="session.end")
    assert "u1" in h.text_closed and h.closes == []
    h.speak_words("u1", ["a", "b"])
    assert h.closes == []
    h.deliver(len(h.audio) - 1)
    assert h.closes == []
    h.deliver()
    assert h.wire[-2]["type"] == "utterance.done" and h.wire[-1] == {"type": "session.ended"}
    assert h.closes == [Close(1000, "session ended")]


def test_session_end_with_nothing_open_ends_at_once() -> None:
    h = Harness()
    h.send(type="session.end")
    assert [m["type"] for m in h.control] == ["session.started", "session.ended"]
    assert h.closes[0].code == 1000
    assert h.send(type="speak.append", utterance_id="u", text="x") == []


def test_no_new_utterance_while_ending() -> None:
    h = Harness()
    h.say("u1", "a", end=False)
    h.send(type="session.end")
    h.say("u2", "b", end=False)
    assert h.errors() == [("invalid_message", "u2")]


def test_binary_frames_are_an_error_not_the_end() -> None:
    h = Harness()
    h.run(h.p.receive_binary(b"\x00\x01"))
    assert h.errors() == [("binary_not_supported", None)]
    h.say("u1", "Hi.")
    assert h.of_type("utterance.started")


def test_oversized_frame_closes_with_1009() -> None:
    h = Harness(GatewayConfig(max_message_bytes=1024))
    h.send(type="speak.append", utterance_id="u1", text="x" * 2000)
    assert h.closes == [Close(1009, "message too big")]
    assert h.send(type="speak.append", utterance_id="u1", text="x") == []
    h2 = Harness(GatewayConfig(max_message_bytes=1024))
    h2.run(h2.p.receive_binary(b"\x00" * 2000))
    assert h2.closes[0].code == 1009


def test_multibyte_text_counts_bytes_for_the_size_limit() -> None:
    h = Harness(GatewayConfig(max_message_bytes=1024))
    h.send(type="speak.append", utterance_id="u1", text="你" * 400)  # 1200 bytes
    assert h.closes and h.closes[0].code == 1009


@pytest.mark.parametrize("frame", ["{", "[]", '{"type": "nope"}', '{"type": "speak.append"}', "null"])
def test_malformed_messages_get_an_error_and_the_session_goes_on(frame: str) -> None:
    h = Harness()
    h.say("u1", "a b", end=False)
    h.run(h.p.receive_text(frame, 0.0))
    assert len(h.errors()) == 1
    h.send(type="speak.end", utterance_id="u1")
    h.speak_words("u1", ["a", "b"])
    assert h.p.utterance("u1").status is Status.GENERATED  # type: ignore[union-attr]


def test_shutdown_refuses_new_utterances_and_abort_closes_1001() -> None:
    h = Harness()
    h.say("u1", "a", end=False)
    h.p.begin_shutdown()
    h.say("u2", "b", end=False)
    assert h.errors() == [("shutting_down", "u2")]
    h.run(h.p.abort())
    assert h.cancelled == ["u1"] and h.closes == [Close(1001, "server shutting down")]
    assert h.p.active_count == 0


def test_history_is_bounded() -> None:
    h = Harness(GatewayConfig(history_size=3))
    for i in range(6):
        h.say(f"u{i}", "a")
        h.speak_words(f"u{i}", ["a"])
        h.deliver()
    assert h.p.utterance("u0") is None and h.p.utterance("u5") is not None
    h.send(type="speak.cancel", utterance_id="u0")
    assert h.errors() == [("unknown_utterance", "u0")]


def test_packet_headers_decode_with_the_client_helper() -> None:
    h = Harness()
    h.say("u1", "a")
    h.speak_words("u1", ["a"], ms_each=50)
    for stream, item in h.audio:
        if isinstance(item, Packet):
            header, payload = unpack_packet(item.frame)
            assert header.stream == stream == 1 and len(payload) == item.samples * 2
