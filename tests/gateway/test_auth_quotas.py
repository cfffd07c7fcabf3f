"""API keys, tokens, origins, quotas, voice-clip checks and the exposure rule, without sockets."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from engine.api import SynthesisRequest
from gateway.auth import (
    ANONYMOUS,
    Authenticator,
    AuthError,
    KeyStore,
    Principal,
    TokenSigner,
    bearer,
    new_key,
    origin_allowed,
    parse_key_line,
)
from gateway.config import GatewayConfig
from gateway.protocol import OpenStream, SendControl, SessionProtocol
from gateway.quotas import OverBudget, QuotaExceeded, QuotaLimits, Quotas, RateLimited
from gateway.server import check_exposure, is_loopback
from gateway.voices import ClipError, check_name, decode_clip
from tests.fakes import FakeEngine


def test_keys_are_stored_hashed_and_verified() -> None:
    key, stored = new_key("agent-1", iterations=1000)
    line = stored.line()
    assert key.startswith("ck_agent-1_") and key[len("ck_agent-1_") :] not in line
    store = KeyStore([parse_key_line(line)])
    assert store.verify(key) == Principal("agent-1")
    assert store.verify(key) == Principal("agent-1")  # cached path
    for wrong in (key[:-1] + ("A" if key[-1] != "A" else "B"), "ck_agent-2_x", "nonsense", ""):
        with pytest.raises(AuthError):
            store.verify(wrong)


def test_key_lines_from_a_file_and_the_environment(tmp_path) -> None:
    k1, s1 = new_key("one", iterations=1000)
    k2, s2 = new_key("two", iterations=1000)
    path = tmp_path / "keys"
    path.write_text(f"# comment\n{s1.line()}\n\n")
    store = KeyStore.load(str(path), s2.line())
    assert store.verify(k1).key_id == "one" and store.verify(k2).key_id == "two"
    with pytest.raises(ValueError):
        parse_key_line("one:plain-text-secret")


def test_tokens_are_signed_expire_and_carry_a_voice_scope() -> None:
    signer = TokenSigner(b"s" * 32)
    token = signer.mint(Principal("k"), ttl_s=60, voices=["Vivian"], now=1000.0)
    principal = signer.verify(token, now=1059.0)
    assert principal.key_id == "k" and principal.voices == frozenset({"Vivian"}) and principal.via_token
    assert principal.may_use_voice("Vivian") and principal.may_use_voice(None)
    assert not principal.may_use_voice("Ryan")
    with pytest.raises(AuthError, match="expired"):
        signer.verify(token, now=1061.0)
    body, sig = token.split(".")
    with pytest.raises(AuthError):
        signer.verify(body + "x." + sig, now=1000.0)
    with pytest.raises(AuthError):
        TokenSigner(b"t" * 32).verify(token, now=1000.0)
    for junk in ("", "a.b.c", "....", "%%%.%%%"):
        with pytest.raises(AuthError):
            signer.verify(junk, now=1000.0)
    # a token minted from a scoped principal never widens the scope
    narrowed = signer.verify(signer.mint(principal, 60, ["Vivian", "Ryan"], now=1000.0), now=1001.0)
    assert narrowed.voices == frozenset({"Vivian"})


def test_authenticator_without_keys_is_open_and_with_keys_needs_them() -> None:
    assert Authenticator(KeyStore(), TokenSigner()).authenticate(None) == ANONYMOUS
    key, stored = new_key("a", iterations=1000)
    auth = Authenticator(KeyStore([stored]), TokenSigner())
    with pytest.raises(AuthError):
        auth.authenticate(None)
    assert auth.authenticate(key).key_id == "a"
    token = auth.signer.mint(Principal("a"), 60, None)
    assert auth.authenticate(token).via_token
    with pytest.raises(AuthError):
        auth.authenticate(token, token_allowed=False)


def test_bearer_and_origins() -> None:
    assert bearer({"authorization": "Bearer abc"}) == "abc"
    assert bearer({"authorization": "Basic abc"}) is None
    assert bearer({}) is None
    assert origin_allowed(None, "h:1", ())
    assert origin_allowed("http://h:1", "h:1", ())  # the gateway's own page
    assert not origin_allowed("https://evil.example", "h:1", ())
    assert origin_allowed("https://app.example", "h:1", ("https://app.example/",))
    assert origin_allowed("https://any.example", "h:1", ("*",))


def test_exposure_rule() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert "loopback" in check_exposure("127.0.0.1", auth_enabled=False, insecure=False)
    with pytest.raises(SystemExit, match="--insecure"):
        check_exposure("0.0.0.0", auth_enabled=False, insecure=False)
    assert check_exposure("0.0.0.0", auth_enabled=False, insecure=True).startswith("INSECURE")
    assert "API keys configured" in check_exposure("0.0.0.0", auth_enabled=True, insecure=False)


def test_quotas_count_sessions_utterances_and_characters() -> None:
    q = Quotas(QuotaLimits(sessions=2, utterances=1, chars_per_minute=600))
    q.open_session("k")
    q.open_session("k")
    with pytest.raises(QuotaExceeded):
        q.open_session("k")
    q.open_session("other")  # per key
    q.close_session("k")
    q.open_session("k")
    q.begin_utterance("k")
    with pytest.raises(QuotaExceeded):
        q.begin_utterance("k")
    q.end_utterance("k")
    q.begin_utterance("k")
    q.take_chars("k", 600, now=0.0)
    with pytest.raises(RateLimited) as info:
        q.take_chars("k", 100, now=1.0)  # 10 chars refilled
    assert info.value.retry_after_s == pytest.approx(9.0)
    q.take_chars("k", 100, now=10.0)
    with pytest.raises(OverBudget):
        q.take_chars("k", 601, now=1000.0)  # never fits: not a rate refusal


def _protocol(quotas: Quotas, **kw: object) -> SessionProtocol:
    return SessionProtocol("s", FakeEngine().info, GatewayConfig(**kw), key_id="k", quotas=quotas)  # type: ignore[arg-type]


def _errors(actions: list) -> list[str]:
    return [a.message["code"] for a in actions if isinstance(a, SendControl) and a.message["type"] == "error"]


def test_protocol_refuses_over_quota_with_typed_errors_and_releases_on_finish() -> None:
    quotas = Quotas(QuotaLimits(utterances=1, chars_per_minute=100))
    p = _protocol(quotas)
    out = p.receive_text('{"type":"speak.append","utterance_id":"a","text":"hello"}', 0.0)
    assert any(isinstance(a, OpenStream) for a in out)
    p.open_succeeded("a")
    assert _errors(p.receive_text('{"type":"speak.append","utterance_id":"b","text":"x"}', 0.0)) == [
        "quota_exceeded"
    ]
    assert _errors(
        p.receive_text('{"type":"speak.append","utterance_id":"a","text":"' + "y" * 99 + '"}', 0.0)
    ) == ["rate_limited"]
    assert quotas.usage("k") == (0, 1)
    p.receive_text('{"type":"speak.cancel","utterance_id":"a"}', 0.0)
    assert quotas.usage("k") == (0, 0)
    out = p.receive_text('{"type":"speak.append","utterance_id":"b","text":"x"}', 0.0)
    assert any(isinstance(a, OpenStream) for a in out) and _errors(out) == []


def test_protocol_utterances_per_session_and_voice_scope() -> None:
    p = SessionProtocol(
        "s",
        FakeEngine().info,
        GatewayConfig(max_utterances_per_session=2),
        allowed_voices=frozenset({"alice"}),
    )
    p.receive_text('{"type":"session.start","voice":"bob"}', 0.0)
    assert _errors(p.receive_text('{"type":"speak.append","utterance_id":"a","text":"x"}', 0.0)) == [
        "unauthorized"
    ]
    p = SessionProtocol("s", FakeEngine().info, GatewayConfig(max_utterances_per_session=2))
    for uid in ("a", "b"):
        p.receive_text(f'{{"type":"speak.append","utterance_id":"{uid}","text":"x"}}', 0.0)
        p.open_succeeded(uid)
        p.receive_text(f'{{"type":"speak.cancel","utterance_id":"{uid}"}}', 0.0)
    assert _errors(p.receive_text('{"type":"speak.append","utterance_id":"c","text":"x"}', 0.0)) == [
        "quota_exceeded"
    ]


def test_text_timeout_ends_an_open_utterance_and_idle_timeout_closes() -> None:
    p = SessionProtocol("s", FakeEngine().info, GatewayConfig(text_timeout_s=5, idle_timeout_s=20))
    p.receive_text('{"type":"speak.append","utterance_id":"a","text":"hello"}', 0.0)
    p.open_succeeded("a")
    assert p.tick(4.0) == []
    names = [type(a).__name__ for a in p.tick(6.0)]
    assert names == ["PushText", "CloseText"]
    assert p.tick(7.0) == []
    p.stream_ended("a")
    p.trailer_sent(p.utterance("a").stream)  # type: ignore[union-attr]
    assert p.tick(19.0) == []
    out = p.tick(21.0)
    assert [(type(a).__name__, getattr(a, "code", None)) for a in out] == [("Close", 1000)]


# -- voice clips ------------------------------------------------------------------------------


def _wav(audio: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, audio, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def _speech(seconds: float, rate: int = 24000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32)
    return np.stack([wave] * channels, axis=1) if channels > 1 else wave


def test_good_clips_decode_to_mono() -> None:
    audio, rate = decode_clip(_wav(_speech(3.0, 16000, channels=2), 16000))
    assert rate == 16000 and audio.ndim == 1 and len(audio) == 48000


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "empty"),
        (b"RIFF....WAVEfmt garbage" * 10, "could not be read"),
        (_wav(_speech(0.5), 24000), "at least 1 s"),
        (_wav(_speech(31.0, 8000), 8000), "at most 30 s"),
        (_wav(np.zeros(48000, np.float32), 24000), "silent"),
        (_wav(_speech(2.0, 8000, channels=4), 8000), "4 channels"),
        (_wav(np.full(24000 * 2, np.nan, np.float32), 24000, subtype="FLOAT"), "NaN"),
        (_wav(_speech(2.0, 2000), 2000), "sample rate"),
    ],
)
def test_bad_clips_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ClipError, match=reason):
        decode_clip(data)


def test_truncated_clip_is_refused() -> None:
    data = _wav(_speech(2.0), 24000)
    with pytest.raises(ClipError):
        decode_clip(data[:60])


def test_voice_names() -> None:
    assert check_name("  My voice ") == "My voice"
    for bad in ("", "   ", "x" * 101, "a\x00b", "line\nbreak", 5, None):
        with pytest.raises(ClipError):
            check_name(bad)


def test_request_with_unknown_voice_still_goes_to_the_engine() -> None:
    # scope only limits voices a token names; the registry's ids are what engines resolve
    assert SynthesisRequest("r", voice="v_0123456789abcdef").voice == "v_0123456789abcdef"
