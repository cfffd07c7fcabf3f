"""speak.pause / speak.unpause in the sans-I/O state machine: the fence, the kept tail, its bound,
the timeout. No sockets: the harness plays the session's part."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.api import AudioChunk
from gateway.bargein import cut_at
from gateway.config import GatewayConfig
from gateway.packets import Packet
from gateway.protocol import Action, Hold, SendAudio, Status, Throttle, Unhold, WakeAt
from tests.gateway.test_protocol import WORDS, Harness, spoken

TEXT = "Sure, I can help you with that."


class PauseHarness(Harness):
    """The harness, plus what the session does for a pause: `Hold` takes the stream's queued
    packets back (and its trailer), `Throttle` and `WakeAt` are recorded."""

    def __init__(self, config: GatewayConfig | None = None) -> None:
        super().__init__(config)
        self.throttles: list[tuple[str, bool]] = []
        self.wakes: list[float] = []
        self.unholds: list[Unhold] = []

    def run(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if isinstance(a, Hold):
                self.actions.append(a)
                mine = [item for stream, item in self.audio if stream == a.stream]
                self.audio = [x for x in self.audio if x[0] != a.stream]
                packets = [p for p in mine if isinstance(p, Packet)]
                self.run(self.p.held(a.utterance_id, packets, len(packets) < len(mine)))
            elif isinstance(a, Throttle):
                self.actions.append(a)
                self.throttles.append((a.utterance_id, a.on))
            elif isinstance(a, WakeAt):
                self.actions.append(a)
                self.wakes.append(a.at)
            elif isinstance(a, Unhold):
                self.actions.append(a)
                self.unholds.append(a)
            else:
                super().run([a])
        return actions

    def packets_on_wire(self, stream: int = 1) -> list[Packet]:
        return [p for p in self.wire if isinstance(p, Packet) and p.stream == stream]


def audio_of(packets: list[Packet]) -> bytes:
    return b"".join(p.payload for p in packets)


def uninterrupted() -> list[Packet]:
    h = PauseHarness()
    spoken(h)
    h.speak_words("u1", [], final=True)
    h.deliver()
    return h.packets_on_wire()


def test_pause_fences_the_stream_and_unpause_goes_on_from_the_first_sample_after_it() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=30)  # 600 ms sent, 70 packets made
    wire_before = len(h.wire)
    actions = h.send(type="speak.pause", utterance_id="u1", played_ms=500)
    assert [type(a).__name__ for a in actions] == ["Hold", "SendControl", "WakeAt"]
    assert h.audio == [] and h.cancelled == []
    paused = h.of_type("utterance.paused")[0]
    cut = cut_at(h.p.utterance("u1").words, TEXT, 500)  # type: ignore[union-attr]
    assert paused == {
        "type": "utterance.paused",
        "utterance_id": "u1",
        "played_ms": 500,
        "position_source": "client",
        "last_word": cut.last_word.to_wire() if cut.last_word else None,
        "partial_word": cut.partial_word.to_wire() if cut.partial_word else None,
        "spoken_text": "Sure, I",
        "unspoken_text": " can help you with that.",
    }
    # the engine goes on: its audio is kept, nothing reaches the lane
    h.speak_words("u1", [], final=True)
    h.deliver()
    assert h.audio == []
    assert len(h.wire) == wire_before + 1  # only utterance.paused
    h.now = 3.0
    actions = h.send(type="speak.unpause", utterance_id="u1")
    assert h.of_type("utterance.unpaused") == [{"type": "utterance.unpaused", "utterance_id": "u1"}]
    [unhold] = h.unholds
    assert unhold.played_samples == 500 * 24
    h.deliver()
    after = h.packets_on_wire()
    assert [p.seq for p in after] == list(range(len(after)))  # no gap, no repeat
    assert audio_of(after) == audio_of(uninterrupted())
    [done] = [m for m in h.wire if isinstance(m, dict) and m["type"] == "utterance.done"]
    assert done["packets"] == len(after)
    assert h.p.utterance("u1").status is Status.DELIVERED  # type: ignore[union-attr]


def test_packets_made_while_paused_are_kept_and_the_trailer_waits_behind_them() -> None:
    h = PauseHarness()
    h.say("u1", TEXT)
    h.speak_words("u1", WORDS[:2], ms_each=200, final=False)
    h.deliver(5)
    h.send(type="speak.pause", utterance_id="u1")
    kept = h.speak_words("u1", WORDS[2:], ms_each=200, final=True)
    assert not [a for a in kept if isinstance(a, SendAudio)]
    assert [m["type"] for m in h.control].count("words") == len(WORDS)  # words still go ahead
    h.send(type="speak.unpause", utterance_id="u1")
    last_two = h.audio[-2:]
    assert isinstance(last_two[0][1], Packet) and last_two[0][1].last
    assert isinstance(last_two[1][1], dict) and last_two[1][1]["type"] == "utterance.done"


def test_a_generated_utterance_gives_back_its_queued_trailer() -> None:
    h = PauseHarness()
    spoken(h)
    h.speak_words("u1", [], final=True)
    h.deliver(10)
    h.send(type="speak.pause", utterance_id="u1")
    assert h.audio == []
    h.send(type="speak.unpause", utterance_id="u1")
    assert [type(item) for _, item in h.audio][-1] is dict
    h.deliver()
    assert audio_of(h.packets_on_wire()) == audio_of(uninterrupted())
    assert len([m for m in h.wire if isinstance(m, dict) and m["type"] == "utterance.done"]) == 1


def test_pause_and_unpause_errors() -> None:
    h = PauseHarness()
    h.send(type="speak.pause", utterance_id="nope")
    h.send(type="speak.unpause", utterance_id="nope")
    spoken(h, deliver_packets=5)
    h.send(type="speak.unpause", utterance_id="u1")
    assert h.errors() == [("unknown_utterance", "nope"), ("unknown_utterance", "nope"), ("not_paused", "u1")]
    h.send(type="speak.cancel", utterance_id="u1")
    h.send(type="speak.pause", utterance_id="u1")
    assert h.errors()[-1] == ("utterance_closed", "u1")


def test_a_repeated_pause_answers_the_same() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=30)
    h.send(type="speak.pause", utterance_id="u1", played_ms=300)
    h.send(type="speak.pause", utterance_id="u1", played_ms=500)
    first, second = h.of_type("utterance.paused")
    assert first == second and first["played_ms"] == 300
    assert sum(isinstance(a, Hold) for a in h.actions) == 1


def test_the_pause_timeout_interrupts_at_the_paused_position() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=30)
    h.now = 0.6
    h.send(type="speak.pause", utterance_id="u1", played_ms=520)
    assert h.wakes == [pytest.approx(0.6 + 5.0)]
    h.now = 5.0
    h.run(h.p.tick(h.now))
    assert not h.of_type("utterance.interrupted")
    h.now = h.wakes[0]
    h.run(h.p.tick(h.now))
    interrupted = h.of_type("utterance.interrupted")[0]
    paused = h.of_type("utterance.paused")[0]
    assert interrupted == {**paused, "type": "utterance.interrupted"}
    assert h.cancelled == ["u1"] and h.p.utterance("u1").status is Status.INTERRUPTED  # type: ignore[union-attr]
    h.send(type="speak.unpause", utterance_id="u1")
    assert h.errors() == [("not_paused", "u1")]
    h.send(type="speak.resume", utterance_id="u2", from_utterance="u1")  # from the paused position
    assert h.p.utterance("u2").text == "can help you with that."  # type: ignore[union-attr]


def test_the_pause_timeout_comes_from_session_start() -> None:
    h = PauseHarness()
    h.send(type="session.start", pause_timeout_ms=800)
    spoken(h, deliver_packets=5)
    h.now = 1.0
    h.send(type="speak.pause", utterance_id="u1")
    assert h.wakes == [pytest.approx(1.8)]
    h.send(type="session.start", pause_timeout_ms=900)
    assert h.errors() == [("session_started", None)]


def test_a_bad_pause_timeout_is_refused() -> None:
    h = PauseHarness()
    h.send(type="session.start", pause_timeout_ms=0)
    h.send(type="session.start", pause_timeout_ms="soon")
    assert [code for code, _ in h.errors()] == ["invalid_message", "invalid_message"]


def test_cancel_while_paused_reports_the_paused_position_unless_told_otherwise() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=40)
    h.send(type="speak.pause", utterance_id="u1", played_ms=450)
    h.now = 4.0
    h.send(type="speak.cancel", utterance_id="u1")
    assert h.of_type("utterance.interrupted")[0]["played_ms"] == 450
    assert h.p.tick(10.0) == []  # the timeout is gone with the pause
    h2 = PauseHarness()
    spoken(h2, deliver_packets=40)
    h2.send(type="speak.pause", utterance_id="u1", played_ms=450)
    h2.send(type="speak.cancel", utterance_id="u1", played_ms=620)
    assert h2.of_type("utterance.interrupted")[0]["played_ms"] == 620


def test_the_server_clock_after_an_unpause_runs_from_the_paused_position() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=60)  # first packet at 0, clock at 1.2 s
    h.now = 0.4
    h.send(type="speak.pause", utterance_id="u1")
    assert h.of_type("utterance.paused")[0]["played_ms"] == 400
    h.now = 2.4  # two seconds paused
    h.send(type="speak.unpause", utterance_id="u1")
    h.now = 2.65
    h.send(type="speak.cancel", utterance_id="u1")
    msg = h.of_type("utterance.interrupted")[0]
    assert (msg["played_ms"], msg["position_source"]) == (650, "server")


def test_a_report_from_before_the_pause_is_not_extrapolated_across_it() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=60)
    h.now = 0.3
    h.send(type="playback.report", utterance_id="u1", played_ms=300)
    h.now = 0.5
    h.send(type="speak.pause", utterance_id="u1")
    assert h.of_type("utterance.paused")[0]["played_ms"] == 500
    h.now = 3.0
    h.send(type="speak.unpause", utterance_id="u1")
    h.now = 3.1
    h.send(type="speak.cancel", utterance_id="u1")
    assert h.of_type("utterance.interrupted")[0]["played_ms"] == 600


def test_the_kept_tail_is_bounded_then_the_engine_is_held_back_and_text_withheld() -> None:
    h = PauseHarness(GatewayConfig(pause_buffer_ms=300))
    h.send(type="speak.append", utterance_id="u1", text="Sure, I can help you. ")
    h.speak_words("u1", WORDS[:1], ms_each=200, final=False)
    h.deliver()
    h.send(type="speak.pause", utterance_id="u1")
    h.speak_words("u1", ["I"], ms_each=200, final=False)  # 200 ms kept: under the bound
    assert h.throttles == []
    h.speak_words("u1", ["can"], ms_each=200, final=False)  # 400 ms: over it
    assert h.throttles == [("u1", True)]
    pushed = len(h.pushed["u1"])
    h.send(type="speak.append", utterance_id="u1", text="More text. And more.")
    h.send(type="speak.end", utterance_id="u1")
    assert len(h.pushed["u1"]) == pushed and "u1" not in h.text_closed  # withheld
    h.speak_words("u1", ["help"], ms_each=200, final=False)  # what the engine already had: kept
    utt = h.p.utterance("u1")
    assert utt is not None and utt.pause is not None and utt.pause.held_samples == 600 * 24
    h.send(type="speak.unpause", utterance_id="u1")
    kinds = [type(a).__name__ for a in h.actions[-5:]]
    assert kinds == ["SendAudio", "Throttle", "PushText", "PushText", "CloseText"]
    assert h.throttles == [("u1", True), ("u1", False)]
    assert [s.text for s in h.pushed["u1"][pushed:]] == ["More text. ", "And more."]
    assert "u1" in h.text_closed


def test_pause_of_a_delivered_utterance_keeps_nothing_and_may_time_out() -> None:
    h = PauseHarness()
    spoken(h)
    h.speak_words("u1", [], final=True)
    h.deliver(seconds_per_packet=0.0)
    h.now = 0.9
    h.send(type="speak.pause", utterance_id="u1")
    paused = h.of_type("utterance.paused")[0]
    assert (paused["played_ms"], paused["position_source"]) == (900, "server")
    h.send(type="speak.unpause", utterance_id="u1")
    assert h.audio == [] and h.of_type("utterance.unpaused")
    h.send(type="speak.pause", utterance_id="u1")  # again, and this time it times out
    h.run(h.p.tick(h.wakes[-1]))
    assert h.of_type("utterance.interrupted")[0]["utterance_id"] == "u1" and h.cancelled == []


def test_pause_and_unpause_without_an_id_take_every_utterance() -> None:
    h = PauseHarness()
    h.say("u1", "One two three.")
    h.say("u2", "Four five six.")
    h.speak_words("u1", ["One"], final=False)
    h.speak_words("u2", ["Four"], final=False)
    h.deliver()
    h.send(type="speak.pause", played_ms=50)
    assert [m["utterance_id"] for m in h.of_type("utterance.paused")] == ["u1", "u2"]
    h.speak_words("u1", ["two"], final=False)
    assert h.audio == []
    h.send(type="speak.unpause")
    assert [m["utterance_id"] for m in h.of_type("utterance.unpaused")] == ["u1", "u2"]
    assert [s for s, _ in h.audio] and {s for s, _ in h.audio} == {1}
    h.send(type="speak.unpause")  # nothing paused: nothing to say
    assert len(h.of_type("utterance.unpaused")) == 2 and h.errors() == []


def test_session_end_waits_for_a_paused_utterance() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=10)
    h.send(type="speak.pause", utterance_id="u1")
    h.send(type="session.end")
    h.speak_words("u1", [], final=True)
    h.deliver()
    assert not h.of_type("session.ended")
    h.send(type="speak.unpause", utterance_id="u1")
    h.deliver()
    assert h.of_type("session.ended") and h.closes


def test_an_engine_failure_while_paused_ends_the_pause() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=10)
    h.send(type="speak.pause", utterance_id="u1")
    h.run(h.p.stream_failed("u1", RuntimeError("boom")))
    assert h.errors() == [("internal", "u1")]
    assert h.p.tick(100.0) == []
    h.send(type="speak.unpause", utterance_id="u1")
    assert h.errors()[-1] == ("not_paused", "u1")


def test_a_late_chunk_after_the_unpause_goes_straight_to_the_lane() -> None:
    h = PauseHarness()
    spoken(h, deliver_packets=70)
    h.send(type="speak.pause", utterance_id="u1")
    h.send(type="speak.unpause", utterance_id="u1")
    chunk = AudioChunk("u1", np.full(480, 0.1, np.float32), 1400 * 24)
    actions: list[Any] = h.run(h.p.receive_chunk("u1", chunk))
    assert [type(a) for a in actions] == [SendAudio]
