"""Gateway limits and defaults, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.messages import ENCODINGS, PACKET_MS, SAMPLE_RATES, TELEPHONY_ENCODINGS, Encoding


@dataclass(slots=True)
class GatewayConfig:
    # a client frame longer than this (bytes) closes the socket with 1009
    max_message_bytes: int = 64 * 1024
    # characters of text in one utterance (all appends); beyond it -> `text_too_long`
    max_text_chars: int = 20_000
    # utterances open at once in one session; beyond it -> `too_many_utterances`
    max_open_utterances: int = 8
    # the segmenter's longest segment, and the shortest text cut at a clause (comma) boundary
    segment_max_chars: int = 300
    segment_clause_min_chars: int = 40
    # output format when the client does not ask for one
    default_encoding: Encoding = "pcm_s16le"
    default_sample_rate: int = 24_000
    default_packet_ms: int = 20
    # pacing "realtime": how far audio may run ahead of real time
    realtime_lead_ms: int = 300
    # per-session send queue, in packets: above `high` the session stops pulling engine audio,
    # and starts again at `low`
    send_queue_high: int = 250
    send_queue_low: int = 50
    # finished utterances remembered per session (for a late speak.cancel and speak.resume)
    history_size: int = 32
    # shutdown: how long open utterances may take to finish before the socket closes with 1001
    drain_timeout_s: float = 5.0
    # REST: output sample rate of /v1/audio/speech (OpenAI's pcm is 24 kHz s16le)
    rest_sample_rate: int = 24_000

    def __post_init__(self) -> None:
        positive = {
            "max_message_bytes": self.max_message_bytes,
            "max_text_chars": self.max_text_chars,
            "max_open_utterances": self.max_open_utterances,
            "segment_max_chars": self.segment_max_chars,
            "send_queue_high": self.send_queue_high,
            "history_size": self.history_size,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_message_bytes < 256:
            raise ValueError("max_message_bytes must be at least 256")
        if not 0 <= self.segment_clause_min_chars <= self.segment_max_chars:
            raise ValueError("segment_clause_min_chars must be between 0 and segment_max_chars")
        if self.default_encoding not in ENCODINGS:
            raise ValueError(f"default_encoding must be one of {ENCODINGS}")
        if self.default_sample_rate not in SAMPLE_RATES:
            raise ValueError(f"default_sample_rate must be one of {SAMPLE_RATES}")
        if self.default_encoding in TELEPHONY_ENCODINGS and self.default_sample_rate != 8000:
            raise ValueError(f"{self.default_encoding} needs default_sample_rate 8000")
        if self.default_packet_ms not in PACKET_MS:
            raise ValueError(f"default_packet_ms must be one of {PACKET_MS}")
        if self.rest_sample_rate not in SAMPLE_RATES:
            raise ValueError(f"rest_sample_rate must be one of {SAMPLE_RATES}")
        if self.realtime_lead_ms < 0:
            raise ValueError("realtime_lead_ms must not be negative")
        if not 0 <= self.send_queue_low < self.send_queue_high:
            raise ValueError("send_queue_low must be in [0, send_queue_high)")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must not be negative")
