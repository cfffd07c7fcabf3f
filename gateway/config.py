"""Gateway limits and defaults, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.messages import ENCODINGS, PACKET_MS, SAMPLE_RATES, TELEPHONY_ENCODINGS, Encoding
from gateway.quotas import QuotaLimits


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
    # pacing "realtime": audio that is due goes on a grid of this period, every packet due by a tick
    # in one write; the client keeps at least `realtime_lead_ms - pacing_tick_ms` buffered. A longer
    # tick puts more packets in each write (fewer writes cost less CPU per stream) at the price of
    # that buffer
    pacing_tick_ms: int = 100
    # per-session send queue, in packets: above `high` the session stops pulling engine audio,
    # and starts again at `low`
    send_queue_high: int = 250
    send_queue_low: int = 50
    # finished utterances remembered per session (for a late speak.cancel and speak.resume)
    history_size: int = 8
    # shutdown: how long open utterances may take to finish before the socket closes with 1001
    drain_timeout_s: float = 5.0
    # REST: output sample rate of /v1/audio/speech (OpenAI's pcm is 24 kHz s16le)
    rest_sample_rate: int = 24_000
    # utterances one session may open in its life; beyond it -> `quota_exceeded`
    max_utterances_per_session: int = 10_000
    # an utterance whose text stays open this long without an append is ended as by speak.end
    text_timeout_s: float = 30.0
    # a paused utterance neither unpaused nor cancelled for this long is interrupted (a session
    # may choose its own in session.start)
    pause_timeout_ms: int = 5_000
    # a paused utterance keeps at most this much audio after the fence; beyond it its engine stream
    # is held back and no more of its text reaches the engine until the unpause
    pause_buffer_ms: int = 10_000
    # a session with nothing in progress and no client message for this long is closed (1000)
    idle_timeout_s: float = 300.0
    # a client that takes no audio for this long while its queue is full is closed (1008), and
    # so is one whose control lane holds more than `control_queue_max` messages
    slow_client_timeout_s: float = 10.0
    control_queue_max: int = 2_000
    # voice registry: reference clip upload size (bytes), seconds allowed to decode it, voices kept
    max_voice_upload_bytes: int = 10 << 20
    voice_decode_timeout_s: float = 5.0
    max_voices: int = 1_000
    # where registered voices are kept (FLAC + JSON); None = in memory only
    voices_dir: str | None = None
    # other vendors' voice names -> engine voices, a JSON object (gateway.compat.voices); None =
    # the CADENCE_VOICE_ALIASES file, else the default table alone
    voice_aliases_file: str | None = None
    # API keys file (hashed lines, gateway.auth); keys also come from CADENCE_API_KEYS
    api_keys_file: str | None = None
    # browser origins allowed to open WebSockets, besides the gateway's own ("*" = any)
    allowed_origins: tuple[str, ...] = ()
    # per-key limits: open sessions, utterances in progress, characters per minute
    quota_limits: QuotaLimits = field(default_factory=QuotaLimits)
    # whether the per-key limits also bind the anonymous principal (no keys configured: one local
    # user, whom the engine's own admission control limits)
    quota_anonymous: bool = False
    # several replicas: Redis shares voices, quotas, the live-utterance directory and control
    # (gateway.cluster.state); None = everything stays in this process
    redis_url: str | None = None
    replica_id: str = "local"  # this replica's name in Redis (unique per replica)

    def __post_init__(self) -> None:
        positive = {
            "max_message_bytes": self.max_message_bytes,
            "max_text_chars": self.max_text_chars,
            "max_open_utterances": self.max_open_utterances,
            "segment_max_chars": self.segment_max_chars,
            "send_queue_high": self.send_queue_high,
            "history_size": self.history_size,
            "max_utterances_per_session": self.max_utterances_per_session,
            "control_queue_max": self.control_queue_max,
            "max_voice_upload_bytes": self.max_voice_upload_bytes,
            "max_voices": self.max_voices,
            "text_timeout_s": self.text_timeout_s,
            "idle_timeout_s": self.idle_timeout_s,
            "pause_timeout_ms": self.pause_timeout_ms,
            "pause_buffer_ms": self.pause_buffer_ms,
            "slow_client_timeout_s": self.slow_client_timeout_s,
            "voice_decode_timeout_s": self.voice_decode_timeout_s,
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
        if not 0 < self.pacing_tick_ms <= max(self.realtime_lead_ms, 20):
            raise ValueError(
                "pacing_tick_ms must be positive and at most realtime_lead_ms (20 if the lead is shorter)"
            )
        if not 0 <= self.send_queue_low < self.send_queue_high:
            raise ValueError("send_queue_low must be in [0, send_queue_high)")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must not be negative")
