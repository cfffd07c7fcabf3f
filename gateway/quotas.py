"""Per-key quotas: open sessions, concurrent utterances, characters per minute (pure Python; the
caller passes the time). Over a limit: `QuotaExceeded` (a count: retry when something finishes,
which the server cannot foresee, so `retry_after_s` is a short hint), `RateLimited` (a rate:
`retry_after_s` says when the budget allows the request) or `OverBudget` (text more than the whole
budget, which no wait lets through: no `retry_after_s`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from gateway.messages import ErrorCode, ProtocolError, whole_ms

# error codes of the limits
RATE_LIMITED: Final[ErrorCode] = "rate_limited"
QUOTA_EXCEEDED: Final[ErrorCode] = "quota_exceeded"
# text the whole budget cannot hold is refused as text too long: it is the request, not the
# moment, that is wrong, and the code already tells clients not to retry as it is
OVER_BUDGET: Final[ErrorCode] = "text_too_long"

# when a count is full, one of the key's sessions or utterances (maybe another client's) has to
# end first; the server cannot know when, so a client is told to look again this much later
COUNT_RETRY_HINT_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    sessions: int = 100  # open WebSocket sessions per key
    utterances: int = 64  # utterances in progress at once per key (WebSocket and REST)
    chars_per_minute: int = 100_000  # characters of text per key, a token bucket refilled per second

    def __post_init__(self) -> None:
        if min(self.sessions, self.utterances, self.chars_per_minute) <= 0:
            raise ValueError("quota limits must be positive")


class QuotaError(ProtocolError):
    """A refusal for a limit; `retry_after_s`: when a retry may be accepted (None: no wait helps)."""

    def __init__(
        self, code: ErrorCode, message: str, retry_after_s: float | None, utterance_id: str | None = None
    ) -> None:
        super().__init__(code, message, utterance_id)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_ms(self) -> int | None:
        return None if self.retry_after_s is None else whole_ms(self.retry_after_s)

    @property
    def retry_after_header(self) -> str | None:
        """`Retry-After` in whole seconds, rounded up and at least 1 (HTTP has no fractions)."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(round(self.retry_after_s, 6))))


class QuotaExceeded(QuotaError):
    def __init__(
        self, message: str, utterance_id: str | None = None, retry_after_s: float | None = COUNT_RETRY_HINT_S
    ) -> None:
        super().__init__(QUOTA_EXCEEDED, message, retry_after_s, utterance_id)


class RateLimited(QuotaError):
    def __init__(self, message: str, retry_after_s: float, utterance_id: str | None = None) -> None:
        super().__init__(RATE_LIMITED, message, retry_after_s, utterance_id)


class OverBudget(QuotaError):
    """Text more than the key's whole characters-per-minute budget: refused for good."""

    def __init__(self, chars: int, per_minute: int, utterance_id: str | None = None) -> None:
        super().__init__(
            OVER_BUDGET,
            f"{chars} characters are more than this key's whole budget of {per_minute} characters "
            "per minute: send the text in smaller parts",
            None,
            utterance_id,
        )


@dataclass(slots=True)
class _Usage:
    sessions: int = 0
    utterances: int = 0
    chars: float = 0.0  # bucket level (characters available)
    refilled_at: float | None = None


@dataclass(slots=True)
class Quotas:
    """Usage per key id against `limits` (or a key's own limits in `per_key`)."""

    limits: QuotaLimits = field(default_factory=QuotaLimits)
    per_key: dict[str, QuotaLimits] = field(default_factory=dict)
    _usage: dict[str, _Usage] = field(default_factory=dict)

    def limits_for(self, key_id: str) -> QuotaLimits:
        return self.per_key.get(key_id, self.limits)

    def usage(self, key_id: str) -> tuple[int, int]:
        """(open sessions, utterances in progress) of a key."""
        u = self._usage.get(key_id)
        return (u.sessions, u.utterances) if u else (0, 0)

    def open_session(self, key_id: str) -> None:
        usage = self._get(key_id)
        limit = self.limits_for(key_id).sessions
        if usage.sessions >= limit:
            raise QuotaExceeded(f"at most {limit} open sessions per key")
        usage.sessions += 1

    def close_session(self, key_id: str) -> None:
        usage = self._get(key_id)
        usage.sessions = max(0, usage.sessions - 1)
        self._forget_if_idle(key_id, usage)

    def begin_utterance(self, key_id: str, utterance_id: str | None = None) -> None:
        usage = self._get(key_id)
        limit = self.limits_for(key_id).utterances
        if usage.utterances >= limit:
            raise QuotaExceeded(f"at most {limit} utterances in progress per key", utterance_id)
        usage.utterances += 1

    def end_utterance(self, key_id: str) -> None:
        usage = self._get(key_id)
        usage.utterances = max(0, usage.utterances - 1)
        self._forget_if_idle(key_id, usage)

    def check_fits(self, key_id: str, count: int, utterance_id: str | None = None) -> None:
        """Raise OverBudget when `count` characters are more than the key's bucket ever holds."""
        per_minute = self.limits_for(key_id).chars_per_minute
        if count > per_minute:
            raise OverBudget(count, per_minute, utterance_id)

    def take_chars(self, key_id: str, count: int, now: float, utterance_id: str | None = None) -> None:
        """Spend `count` characters, or raise RateLimited (or OverBudget) without spending any."""
        self.check_fits(key_id, count, utterance_id)
        per_minute = self.limits_for(key_id).chars_per_minute
        usage = self._get(key_id)
        if usage.refilled_at is None:
            usage.chars, usage.refilled_at = float(per_minute), now
        usage.chars = min(float(per_minute), usage.chars + (now - usage.refilled_at) * per_minute / 60.0)
        usage.refilled_at = now
        if count > usage.chars:
            # the bucket refills at per_minute / 60 a second: the time until it holds `count`
            wait = (count - usage.chars) * 60.0 / per_minute
            raise RateLimited(
                f"over {per_minute} characters per minute; retry in {wait:.1f} s", wait, utterance_id
            )
        usage.chars -= count

    def _get(self, key_id: str) -> _Usage:
        return self._usage.setdefault(key_id, _Usage())

    def _forget_if_idle(self, key_id: str, usage: _Usage) -> None:
        # a key with nothing open and a full bucket carries no state worth keeping
        if usage.sessions == 0 and usage.utterances == 0 and usage.refilled_at is None:
            self._usage.pop(key_id, None)
