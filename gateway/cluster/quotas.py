"""Per-key quotas across replicas: decided here, from local counts, reconciled through Redis in
the background, so a session's hot path (session open, utterance start, text append, utterance
end) never waits on the network.

Counts. Each replica counts its own open sessions and utterances in progress, exactly (every open
and close goes through it), and publishes them in one hash, `{prefix}usage:{replica}` ->
{"s:{key_id}": sessions, "u:{key_id}": utterances, "_seq": version}. A change is written within a
moment by one writer task (the changed fields, with a message on `{prefix}usage` that the other
replicas apply at once); every heartbeat rewrites the whole hash, so whatever the store lost or
missed (a restart, with or without persistence) is exact again at the next beat, and at once when
the store comes back. The hash expires with the replica's heartbeat: a replica that dies stops
counting. A limit is checked against this replica's count plus the last known counts of the
other live replicas (`_others`, refreshed from the message and read in full every beat; a
version number keeps an older read from undoing a newer message). Two replicas admitting at the
same moment can therefore pass a limit by what arrives within the propagation delay.

Characters per minute. Each replica spends from a local token bucket; what it spent is sent to a
shared bucket `{prefix}chars:{key_id}` (a Lua script, on Redis' clock) with the next write, and
the shared level, which counts every replica's spending, comes back and lowers the local one.
A refusal's `retry_after_s` is therefore when the local bucket, lowered that way, holds the request:
it counts what the other replicas spent up to the last write, and what they spend after it may
refuse the retry again (with a new time). Text over the key's whole budget is refused before any
of this (gateway.quotas.OverBudget): it spends nothing here and reaches no shared bucket.

While the store is unreachable (gateway.cluster.store), each replica enforces every limit on its
own counts only: the cluster as a whole may then admit up to one limit per replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from gateway.cluster.store import Store, StoreUnavailable
from gateway.quotas import QuotaExceeded, QuotaLimits, Quotas

log = logging.getLogger("cadence.redis")

HEARTBEAT_TTL_S: Final = 5
BUCKET_IDLE_S: Final = 60.0  # a key's bucket is synchronised while it spent within this long

# KEYS[1] the shared bucket; ARGV: per_minute, spent. Refill on Redis' clock, spend (the level may
# go below zero by at most one minute's budget: spending another replica allowed), return the level.
_SPEND = """
local per_minute = tonumber(ARGV[1])
local spent = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(state[1]) or per_minute
local at = tonumber(state[2]) or now
level = math.min(per_minute, level + (now - at) * per_minute / 60.0)
level = math.max(-per_minute, level - spent)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return tostring(level)
"""


def _field(kind: str, key_id: str) -> str:
    return f"{kind}:{key_id}"


class SharedQuotas(Quotas):
    """Quotas shared by every replica that uses the same store and prefix."""

    def __init__(
        self,
        store: Store,
        replica_id: str,
        limits: QuotaLimits,
        prefix: str = "cadence:",
        per_key: Mapping[str, QuotaLimits] | None = None,
    ) -> None:
        super().__init__(limits, dict(per_key or {}))
        self.store = store
        self.replica_id = replica_id
        self.prefix = prefix
        self.channel = f"{prefix}usage"
        self.members = f"{prefix}replicas"
        self._others: dict[str, dict[str, int]] = {}  # live replica -> its counts
        self._seen: dict[str, int] = {}  # replica -> the version of its counts held in _others
        self._seq = time.time_ns()  # versions of this replica's counts (a restart starts above)
        self._dirty: set[str] = set()
        self._spent: dict[str, int] = {}  # characters spent here, not yet sent to the shared bucket
        self._bucket_used: dict[str, float] = {}  # key -> when it last spent here
        self._changed = asyncio.Event()
        self._writing = asyncio.Lock()  # one write at a time: they reach the store in order
        self._spend = store.client.register_script(_SPEND)
        self._refused_at = -1e9

    def usage_key(self, replica_id: str) -> str:
        return f"{self.prefix}usage:{replica_id}"

    def heartbeat_key(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}"

    # -- the hot path: local only ---------------------------------------------------------------
    def _elsewhere(self, field: str) -> int:
        if not self.store.up:
            return 0  # degraded: this replica's own counts only
        return sum(counts.get(field, 0) for counts in self._others.values())

    def _mark(self, field: str) -> None:
        self._dirty.add(field)
        self._changed.set()

    def usage(self, key_id: str) -> tuple[int, int]:
        """(open sessions, utterances in progress) of a key, over all replicas as known here."""
        sessions, utterances = super().usage(key_id)
        return (
            sessions + self._elsewhere(_field("s", key_id)),
            utterances + self._elsewhere(_field("u", key_id)),
        )

    def open_session(self, key_id: str) -> None:
        usage = self._get(key_id)
        limit = self.limits_for(key_id).sessions
        if usage.sessions + self._elsewhere(_field("s", key_id)) >= limit:
            raise QuotaExceeded(f"at most {limit} open sessions per key")
        usage.sessions += 1
        self._mark(_field("s", key_id))

    def close_session(self, key_id: str) -> None:
        super().close_session(key_id)
        self._mark(_field("s", key_id))

    def begin_utterance(self, key_id: str, utterance_id: str | None = None) -> None:
        usage = self._get(key_id)
        limit = self.limits_for(key_id).utterances
        if usage.utterances + self._elsewhere(_field("u", key_id)) >= limit:
            raise QuotaExceeded(f"at most {limit} utterances in progress per key", utterance_id)
        usage.utterances += 1
        self._mark(_field("u", key_id))

    def end_utterance(self, key_id: str) -> None:
        super().end_utterance(key_id)
        self._mark(_field("u", key_id))

    def take_chars(self, key_id: str, count: int, now: float, utterance_id: str | None = None) -> None:
        super().take_chars(key_id, count, now, utterance_id)
        self._spent[key_id] = self._spent.get(key_id, 0) + count
        self._bucket_used[key_id] = now
        self._changed.set()

    def _count(self, field: str) -> int:
        kind, _, key_id = field.partition(":")
        sessions, utterances = super().usage(key_id)
        return sessions if kind == "s" else utterances

    def _mine(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for key_id in list(self._usage):
            sessions, utterances = super().usage(key_id)
            if sessions:
                counts[_field("s", key_id)] = sessions
            if utterances:
                counts[_field("u", key_id)] = utterances
        return counts

    # -- the writer -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Write each change soon after it is made, until cancelled."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if not self.store.up:
                continue  # the whole state is written again when the store comes back
            try:
                await self.write(full=False)
            except StoreUnavailable:
                pass  # the breaker logged it; the beat after recovery writes everything
            except Exception as exc:  # the store refused the write (out of memory, ...)
                now = time.monotonic()
                if now - self._refused_at > 60:
                    self._refused_at = now
                    log.error("the shared store refused this replica's quota counts: %s", exc)

    async def write(self, full: bool) -> None:
        """Send this replica's counts: the changed ones, or all of them with the heartbeat (full),
        and the characters spent since the last write; the shared buckets' levels come back."""
        async with self._writing:
            fields = self._mine() if full else {f: self._count(f) for f in self._dirty}
            self._dirty.clear()
            spent, self._spent = self._spent, {}
            now = time.monotonic()
            # what was spent goes with every write; the heartbeat's also brings back the levels
            # of every key that spent here lately (what the other replicas spent since)
            synced = list(spent)
            if full:
                for key in [k for k, used in self._bucket_used.items() if now - used >= BUCKET_IDLE_S]:
                    del self._bucket_used[key]
                synced += [k for k in self._bucket_used if k not in spent]
            self._seq += 1
            mine = self.usage_key(self.replica_id)
            pipe = self.store.client.pipeline(transaction=True)
            if full:
                pipe.set(self.heartbeat_key(self.replica_id), str(time.time()), ex=HEARTBEAT_TTL_S)
                pipe.sadd(self.members, self.replica_id)
                pipe.delete(mine)
            for name, value in fields.items():
                if value:
                    pipe.hset(mine, name, value)
                else:
                    pipe.hdel(mine, name)
            pipe.hset(mine, "_seq", self._seq)
            pipe.expire(mine, HEARTBEAT_TTL_S)
            message = {"replica": self.replica_id, "seq": self._seq, "full": full, "counts": fields}
            pipe.publish(self.channel, json.dumps(message))
            for key_id in synced:
                per_minute = self.limits_for(key_id).chars_per_minute
                await self._spend(
                    keys=[f"{self.prefix}chars:{key_id}"],
                    args=[per_minute, spent.get(key_id, 0)],
                    client=pipe,
                )
            try:
                results = await self.store.execute(pipe)
            except Exception:
                if not full:
                    self._dirty.update(fields)
                # the characters go with the next write, else the shared budget never counts
                # them (a write that timed out yet was applied counts them twice: the safer side)
                for key_id, count in spent.items():
                    self._spent[key_id] = self._spent.get(key_id, 0) + count
                raise
            for key_id, level in zip(synced, results[len(results) - len(synced) :], strict=True):
                self._lower_bucket(key_id, float(level))

    def _lower_bucket(self, key_id: str, shared_level: float) -> None:
        """The shared level counts every replica's spending (and this one's up to the write);
        what was spent here since comes off it."""
        usage = self._usage.get(key_id)
        if usage is None or usage.refilled_at is None:
            return
        now = time.monotonic()
        per_minute = self.limits_for(key_id).chars_per_minute
        local = min(float(per_minute), usage.chars + (now - usage.refilled_at) * per_minute / 60.0)
        usage.chars = min(local, shared_level - self._spent.get(key_id, 0))
        usage.refilled_at = now

    # -- the other replicas -------------------------------------------------------------------------
    def on_message(self, data: bytes) -> None:
        """A replica's counts changed (its message on `{prefix}usage`)."""
        message: dict[str, Any] = json.loads(data)
        replica = str(message["replica"])
        seq = int(message["seq"])
        if replica == self.replica_id or seq <= self._seen.get(replica, -1):
            return
        counts: dict[str, int] = {str(k): int(v) for k, v in dict(message["counts"]).items()}
        held = {} if message.get("full") else self._others.get(replica, {})
        held.update(counts)
        self._others[replica] = {k: v for k, v in held.items() if v}
        self._seen[replica] = seq

    async def read_others(self) -> None:
        """Every live replica's counts, read whole; replicas whose heartbeat expired are dropped."""
        members = sorted(
            m.decode() if isinstance(m, bytes) else str(m)
            for m in await self.store.client.smembers(self.members)
        )
        others = [m for m in members if m != self.replica_id]
        results: list[Any] = []
        if others:
            pipe = self.store.client.pipeline(transaction=False)
            for replica in others:
                pipe.exists(self.heartbeat_key(replica))
                pipe.hgetall(self.usage_key(replica))
            results = await self.store.execute(pipe)
        live: dict[str, dict[str, int]] = {}
        dead = []
        for i, replica in enumerate(others):
            alive, raw = results[2 * i], results[2 * i + 1]
            if not alive:
                dead.append(replica)
                continue
            counts = {(k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in dict(raw).items()}
            seq = counts.pop("_seq", -1)
            if seq < self._seen.get(replica, -1):
                live[replica] = self._others.get(replica, {})  # a newer message came meanwhile
                continue
            live[replica] = {k: v for k, v in counts.items() if v}
            self._seen[replica] = seq
        self._others = live
        for replica in set(self._seen) - set(live):
            del self._seen[replica]
        if dead:
            await self.store.client.srem(self.members, *dead)

    async def live_replicas(self) -> list[str]:
        """The replicas with a live heartbeat, this one included."""
        await self.read_others()
        return sorted({self.replica_id, *self._others})
