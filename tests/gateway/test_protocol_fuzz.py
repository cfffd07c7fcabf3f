"""Fuzzing the sans-I/O session protocol: more than 100 000 generated client frames (valid,
near-valid and hostile) interleaved with simulated engine output, sends and disconnect-like
aborts. Nothing may raise; each hostile frame gets the error the protocol names; a valid one never
gets `invalid_message` / `unknown_type`; no audio of a stream follows its fence; packets of a
stream are numbered without gaps (across a pause too); no audio of a paused stream goes out before
its unpause; nothing follows a Close."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import AudioChunk, EngineError, Overloaded, WordTiming
from gateway.config import GatewayConfig
from gateway.messages import encode
from gateway.protocol import (
    Action,
    CancelStream,
    Close,
    Hold,
    OpenStream,
    Purge,
    PushText,
    SendAudio,
    SendControl,
    SendTrailer,
    SessionProtocol,
)
from gateway.quotas import QuotaLimits, Quotas
from tests.fakes import FakeEngine

IDS = ["u1", "u2", "u3", "u4", "x" * 128]
TEXTS = [
    "Hello there. ",
    "你好，世界。",
    "<zh>购买</zh><en>iPhone 15</en>",
    "3.14 is pi",
    "",
    " ",
    "a" * 300,
    "\u200b\u0000",
    "<en",
    "n>ok</en>",
    "e.g. Dr. Who? ",
    "\n\n",
]
HOSTILE: list[tuple[str, str]] = [
    ("not json", "invalid_message"),
    ("{", "invalid_message"),
    ("[]", "invalid_message"),
    ("1", "invalid_message"),
    ("null", "invalid_message"),
    ('"speak.append"', "invalid_message"),
    ("{}", "invalid_message"),
    ('{"type": 5}', "invalid_message"),
    ('{"type": null}', "invalid_message"),
    ('{"type": "nope"}', "unknown_type"),
    ('{"type": "speak.appendx"}', "unknown_type"),
    ('{"type": "SPEAK.APPEND"}', "unknown_type"),
    ('{"type": "speak.append"}', "invalid_message"),
    ('{"type": "speak.append", "utterance_id": 5, "text": "a"}', "invalid_message"),
    ('{"type": "speak.append", "utterance_id": "u1", "text": ["a"]}', "invalid_message"),
    ('{"type": "speak.append", "utterance_id": "", "text": "a"}', "invalid_message"),
    ('{"type": "speak.append", "utterance_id": "' + "y" * 129 + '", "text": "a"}', "invalid_message"),
    ('{"type": "speak.append", "utterance_id": "u1", "text": "a", "flush": "yes"}', "invalid_message"),
    ('{"type": "speak.cancel", "played_ms": -1}', "invalid_message"),
    ('{"type": "speak.cancel", "played_ms": "10"}', "invalid_message"),
    ('{"type": "speak.cancel", "played_ms": 1e300}', "invalid_message"),
    ('{"type": "playback.report", "utterance_id": "u1"}', "invalid_message"),
    ('{"type": "speak.resume", "utterance_id": "u9"}', "invalid_message"),
    ('{"type": "speak.append", "utterance_id": "\\ud800", "text": "a"}', "invalid_message"),
    ("\udcff\udcfe", "invalid_message"),
    ('{"type": "speak.flush", "utterance_id": {}}', "invalid_message"),
    ("[" * 5000 + "]" * 5000, "invalid_message"),
]
HOSTILE_START = [
    ('{"type": "session.start", "output": {"encoding": "mp3"}}', "unsupported_output"),
    ('{"type": "session.start", "output": {"sample_rate": 12345}}', "unsupported_output"),
    ('{"type": "session.start", "output": 7}', "invalid_message"),
    ('{"type": "session.start", "timestamps": "all"}', "invalid_message"),
]


def valid_message(rng: random.Random) -> dict[str, Any]:
    uid = rng.choice(IDS)
    kind = rng.choices(
        [
            "speak.append",
            "speak.flush",
            "speak.end",
            "speak.cancel",
            "speak.resume",
            "playback.report",
            "session.start",
            "session.end",
            "speak.pause",
            "speak.unpause",
        ],
        weights=[30, 5, 10, 8, 4, 4, 2, 1, 6, 5],
    )[0]
    if kind == "speak.append":
        return {
            "type": kind,
            "utterance_id": uid,
            "text": rng.choice(TEXTS),
            "flush": rng.random() < 0.2,
            "extra": rng.random(),
        }  # unknown fields are ignored
    if kind in ("speak.cancel", "speak.pause", "speak.unpause"):
        msg: dict[str, Any] = {"type": kind}
        if rng.random() < 0.8:
            msg["utterance_id"] = uid
        if rng.random() < 0.5 and kind != "speak.unpause":
            msg["played_ms"] = rng.randint(0, 5000)
        return msg
    if kind == "speak.resume":
        return {"type": kind, "utterance_id": rng.choice(IDS), "from_utterance": uid}
    if kind == "playback.report":
        return {"type": kind, "utterance_id": uid, "played_ms": rng.randint(0, 5000)}
    if kind == "session.start":
        return {
            "type": kind,
            "voice": rng.choice([None, "alice", "nobody"]),
            "language": rng.choice(["Auto", "zh"]),
            "output": rng.choice([{}, {"encoding": "mulaw"}, {"sample_rate": 16000, "packet_ms": 40}]),
            "pause_timeout_ms": rng.choice([None, 50, 2000]),
        }
    if kind in ("speak.flush", "speak.end"):
        return {"type": kind, "utterance_id": uid}
    return {"type": kind}


def garbage(rng: random.Random) -> str:
    return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 40)))


class Harness:
    """A protocol, the engine simulated around it, and the invariants checked on every action."""

    def __init__(self, rng: random.Random, config: GatewayConfig) -> None:
        self.rng = rng
        self.config = config
        self.engine = FakeEngine().info
        self.sessions = 0
        self.frames = 0
        self.now = 0.0
        self._new_session()

    def _new_session(self) -> None:
        self.sessions += 1
        self.p = SessionProtocol(
            f"s{self.sessions}",
            self.engine,
            self.config,
            quotas=Quotas(QuotaLimits(utterances=6, chars_per_minute=50_000)),
        )
        self.opening: list[str] = []
        self.producing: dict[str, int] = {}  # utterance id -> engine samples produced
        self.queue: list[tuple[int, Any]] = []  # the audio lane: (stream, packet or trailer)
        self.fenced: set[int] = set()
        self.paused: dict[str, int] = {}  # utterance id -> stream, between Hold and the unpause
        self.next_seq: dict[int, int] = {}
        self.closed = False

    def run(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            assert not self.closed, f"{action} after Close"
            if isinstance(action, SendControl):
                message = action.message
                encode(message).encode("utf-8")  # what the socket will do with it
                if message["type"] == "utterance.interrupted":
                    utt = self.p.utterance(message["utterance_id"])
                    assert utt is not None
                    self.fenced.add(utt.stream)
                    self.paused.pop(utt.utterance_id, None)
                    assert all(s != utt.stream for s, _ in self.queue)
                elif message["type"] == "utterance.paused":
                    assert message["utterance_id"] in self.paused
                    assert all(s != self.paused[message["utterance_id"]] for s, _ in self.queue)
                elif message["type"] == "utterance.unpaused":
                    self.paused.pop(message["utterance_id"])
            elif isinstance(action, Hold):
                self.paused[action.utterance_id] = action.stream
                taken = [item for s, item in self.queue if s == action.stream]
                self.queue = [q for q in self.queue if q[0] != action.stream]
                packets = [p for p in taken if p is not None]
                if packets:  # they come again at the unpause, in their places
                    self.next_seq[action.stream] = packets[0].header.seq
                self.run(self.p.held(action.utterance_id, packets, len(packets) < len(taken)))
            elif isinstance(action, SendAudio):
                assert action.stream not in self.fenced, "audio after the fence"
                assert action.stream not in self.paused.values(), "audio of a paused stream"
                for packet in action.packets:
                    expected = self.next_seq.get(action.stream, 0)
                    assert packet.header.seq == expected
                    self.next_seq[action.stream] = expected + 1
                    self.queue.append((action.stream, packet))
            elif isinstance(action, SendTrailer):
                assert action.stream not in self.fenced
                assert action.stream not in self.paused.values()
                self.queue.append((action.stream, None))
            elif isinstance(action, Purge):
                self.queue = [q for q in self.queue if q[0] != action.stream]
            elif isinstance(action, OpenStream):
                self.opening.append(action.utterance_id)
            elif isinstance(action, PushText):
                assert action.segment.text.strip()
            elif isinstance(action, CancelStream):
                self.producing.pop(action.utterance_id, None)
            elif isinstance(action, Close):
                self.closed = True
        return actions

    def client_frame(self) -> None:
        rng = self.rng
        self.frames += 1
        roll = rng.random()
        expected: str | None = None
        if roll < 0.55:
            frame = encode(valid_message(rng))
        elif roll < 0.85:
            frame, expected = rng.choice(HOSTILE)
        elif roll < 0.9 and not self.p.started:
            frame, expected = rng.choice(HOSTILE_START)
        elif roll < 0.95:
            frame, expected = garbage(rng), "invalid_message"
            try:
                json.loads(frame)
                expected = None  # a random string can be valid JSON (a number)
            except ValueError:
                pass
        else:
            self.run(self.p.receive_binary(rng.randbytes(rng.randint(0, 64))))
            return
        was_closed = self.p.closed
        out = self.run(self.p.receive_text(frame, self.now))
        codes = [
            a.message["code"] for a in out if isinstance(a, SendControl) and a.message["type"] == "error"
        ]
        if was_closed:
            assert out == []
        elif expected is not None:
            assert codes and codes[0] == expected, (frame[:80], codes)
        else:
            assert "invalid_message" not in codes or self.p.ending, (frame[:80], codes)
            assert "unknown_type" not in codes

    def engine_step(self) -> None:
        rng = self.rng
        while self.opening:
            uid = self.opening.pop(0)
            if rng.random() < 0.1:
                self.run(self.p.open_failed(uid, Overloaded()))
            else:
                self.run(self.p.open_succeeded(uid))
                self.producing[uid] = 0
        for uid in list(self.producing):
            r = rng.random()
            if r < 0.03:
                self.producing.pop(uid)
                self.run(self.p.stream_failed(uid, EngineError("boom")))
            elif r < 0.08:
                self.producing.pop(uid)
                self.run(self.p.stream_ended(uid))
            elif r < 0.6:
                offset = self.producing[uid] + (rng.randint(-50, 50) if rng.random() < 0.1 else 0)
                n = rng.choice([0, 240, 480, 1000])
                word = WordTiming("w", max(0, offset), max(0, offset) + n, 0, 1)
                final = rng.random() < 0.05
                self.run(
                    self.p.receive_chunk(
                        uid,
                        AudioChunk(uid, np.zeros(n, np.float32), max(0, offset), (word,) if n else (), final),
                    )
                )
                self.producing[uid] = max(0, offset) + n
                if final:
                    self.producing.pop(uid)

    def writer_step(self) -> None:
        for _ in range(self.rng.randint(0, 4)):
            if not self.queue:
                return
            stream, item = self.queue.pop(0)
            if item is None:
                self.run(self.p.trailer_sent(stream))
            else:
                self.run(self.p.packet_sent(stream, item, self.now))

    def step(self) -> None:
        self.now += self.rng.random() * 0.05
        self.client_frame()
        self.engine_step()
        self.writer_step()
        r = self.rng.random()
        if r < 0.002 and not self.closed:  # server shutdown / client gone mid-anything
            self.run(self.p.abort())
        elif r < 0.01 and not self.closed:
            self.run(self.p.tick(self.now + self.rng.choice([0, 40, 400])))
        if self.closed:
            self._new_session()


def test_100k_generated_frames_at_the_sans_io_protocol() -> None:
    config = GatewayConfig(max_open_utterances=4, history_size=8, max_text_chars=2_000, text_timeout_s=30)
    harness = Harness(random.Random(20261129), config)
    while harness.frames < 100_000:
        harness.step()
    assert harness.frames >= 100_000
    assert harness.sessions > 20  # sessions were closed and replaced along the way


_frames = st.one_of(
    st.builds(
        encode,
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(
                    [
                        "speak.append",
                        "speak.end",
                        "speak.cancel",
                        "speak.flush",
                        "session.end",
                        "playback.report",
                        "speak.resume",
                        "session.start",
                        "speak.pause",
                        "speak.unpause",
                        "x",
                    ]
                ),
                "utterance_id": st.one_of(
                    st.none(), st.sampled_from(IDS), st.integers(), st.text(max_size=3)
                ),
                "text": st.one_of(st.text(max_size=30), st.integers(), st.none()),
                "played_ms": st.one_of(
                    st.none(),
                    st.integers(-5, 10**10),
                    st.floats(allow_nan=True, allow_subnormal=False),
                    st.text(max_size=2),
                ),
                "from_utterance": st.sampled_from(IDS),
            }
        ),
    ),
    st.text(max_size=50),
    st.sampled_from([f for f, _ in HOSTILE]),
)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_frames, max_size=60), st.integers(0, 2**32))
def test_hypothesis_frames_never_break_the_protocol(frames: list[str], seed: int) -> None:
    harness = Harness(random.Random(seed), GatewayConfig(max_open_utterances=3))
    for frame in frames:
        if harness.closed:
            harness._new_session()
        harness.run(harness.p.receive_text(frame, harness.now))
        harness.engine_step()
        harness.writer_step()
