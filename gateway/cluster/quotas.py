"""Per-key quotas counted across replicas in Redis.

Counts (open sessions, utterances in progress) are kept per replica in one hash per key and limit,
`{prefix}q:{kind}:{key_id}` -> {replica_id: count}; a Lua script sums the fields of live replicas
(those whose heartbeat key exists), drops the fields of dead ones, and increments this replica's
field only if the sum is under the limit: atomic, and a replica that dies without cleaning up
stops counting when its heartbeat expires. The characters-per-minute bucket is one hash per key,
refilled and spent atomically by a second script on Redis' own clock.

The Quotas interface is synchronous (the sans-I/O protocol calls it), so these calls use a
blocking client: one loopback round trip (~0.1 ms) per session open, utterance start and text
append. When Redis cannot be reached the call is allowed (and logged): an outage of the shared
store must not stop speech; the engine's own admission control still bounds the load.
"""

from __future__ import annotations

import logging
import time

import redis

from gateway.quotas import QuotaExceeded, QuotaLimits, Quotas, RateLimited

log = logging.getLogger("cadence.redis")

_ACQUIRE = """
local total = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local replica = fields[i]
  if replica == ARGV[1] or redis.call('EXISTS', ARGV[3] .. replica) == 1 then
    total = total + tonumber(fields[i + 1])
  else
    redis.call('HDEL', KEYS[1], replica)
  end
end
if total >= tonumber(ARGV[2]) then return -1 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('EXPIRE', KEYS[1], 86400)
return total + 1
"""

_RELEASE = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if n <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return n
"""

# KEYS[1] bucket hash; ARGV: per_minute, count. Returns 0 (spent) or the wait in milliseconds.
_TAKE_CHARS = """
local per_minute = tonumber(ARGV[1])
local count = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(state[1]) or per_minute
local at = tonumber(state[2]) or now
level = math.min(per_minute, level + (now - at) * per_minute / 60.0)
if count > level then
  redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[1], 120)
  return math.ceil((count - level) * 60000.0 / per_minute)
end
redis.call('HSET', KEYS[1], 'level', tostring(level - count), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return 0
"""


class SharedQuotas(Quotas):
    """Quotas whose counts live in Redis, shared by every replica using the same prefix."""

    def __init__(
        self, client: redis.Redis, replica_id: str, limits: QuotaLimits, prefix: str = "cadence:"
    ) -> None:
        super().__init__(limits)
        self.client = client
        self.replica_id = replica_id
        self.prefix = prefix
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._take = client.register_script(_TAKE_CHARS)
        self._warned_at = 0.0

    def heartbeat_prefix(self) -> str:
        return f"{self.prefix}replica:"

    def _key(self, kind: str, key_id: str) -> str:
        return f"{self.prefix}q:{kind}:{key_id}"

    def _unreachable(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._warned_at > 10:
            self._warned_at = now
            log.warning("Redis unreachable for quotas (%s): allowing the request", exc)

    def _count_up(self, kind: str, key_id: str, limit: int) -> bool:
        try:
            result = self._acquire(
                keys=[self._key(kind, key_id)], args=[self.replica_id, limit, self.heartbeat_prefix()]
            )
        except redis.RedisError as exc:
            self._unreachable(exc)
            return True
        return int(result) >= 0

    def _count_down(self, kind: str, key_id: str) -> None:
        try:
            self._release(keys=[self._key(kind, key_id)], args=[self.replica_id])
        except redis.RedisError as exc:
            self._unreachable(exc)

    def usage(self, key_id: str) -> tuple[int, int]:
        """(open sessions, utterances in progress) of a key, over all replicas."""
        try:
            sessions = sum(int(v) for v in self.client.hvals(self._key("sessions", key_id)))
            utterances = sum(int(v) for v in self.client.hvals(self._key("utterances", key_id)))
        except redis.RedisError as exc:
            self._unreachable(exc)
            return (0, 0)
        return sessions, utterances

    def open_session(self, key_id: str) -> None:
        limit = self.limits_for(key_id).sessions
        if not self._count_up("sessions", key_id, limit):
            raise QuotaExceeded(f"at most {limit} open sessions per key")

    def close_session(self, key_id: str) -> None:
        self._count_down("sessions", key_id)

    def begin_utterance(self, key_id: str, utterance_id: str | None = None) -> None:
        limit = self.limits_for(key_id).utterances
        if not self._count_up("utterances", key_id, limit):
            raise QuotaExceeded(f"at most {limit} utterances in progress per key", utterance_id)

    def end_utterance(self, key_id: str) -> None:
        self._count_down("utterances", key_id)

    def take_chars(self, key_id: str, count: int, now: float, utterance_id: str | None = None) -> None:
        per_minute = self.limits_for(key_id).chars_per_minute
        if count > per_minute:
            raise RateLimited(f"at most {per_minute} characters per minute per key", 60.0, utterance_id)
        try:
            wait_ms = int(self._take(keys=[self._key("chars", key_id)], args=[per_minute, count]))
        except redis.RedisError as exc:
            self._unreachable(exc)
            return
        if wait_ms > 0:
            wait = wait_ms / 1000.0
            raise RateLimited(
                f"over {per_minute} characters per minute; retry in {wait:.1f} s", wait, utterance_id
            )
