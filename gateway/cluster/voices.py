"""The voice registry shared through Redis: a voice registered on one replica is usable on all.

Each voice is one hash `{prefix}voice:{id}` (metadata JSON and the clip as FLAC) and a member of
the set `{prefix}voices`; additions and deletions are announced on `{prefix}voices:events`. Each
replica keeps its own copy of the voices (and the engine's prompt cache stays local, in the
engine): it fills them from Redis at start-up, on each announcement, and on a periodic
resynchronisation that also repairs whatever was missed while Redis was away. A deletion, however
a replica hears of it, also releases the voice from that replica's engine.

While the store is unreachable a registration still succeeds on the replica that took it (the
voice is usable there at once) and is written through when the store is back; a deletion is
applied here at once and in the store when it answers. A store restarted without persistence
gets every voice back from the replicas that hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import soundfile as sf

from engine.api import Engine
from gateway.cluster.store import Store
from gateway.config import GatewayConfig
from gateway.voices import VOICE_ID, Voice, VoiceRegistry

log = logging.getLogger("cadence.redis")

WRITE_TIMEOUT_S = 5.0  # a clip is up to a few megabytes


def voice_to_redis(voice: Voice) -> dict[Any, Any]:  # the field mapping redis-py's hset takes
    buffer = io.BytesIO()
    sf.write(buffer, voice.audio, voice.sample_rate, format="FLAC")
    meta = {"name": voice.name, "owner": voice.owner, "text": voice.text, "created_at": voice.created_at}
    return {"meta": json.dumps(meta, ensure_ascii=False).encode(), "audio": buffer.getvalue()}


def voice_from_redis(voice_id: str, fields: Mapping[Any, Any]) -> Voice:
    meta = json.loads(fields[b"meta"])
    audio, rate = sf.read(io.BytesIO(fields[b"audio"]), dtype="float32")
    return Voice(
        voice_id,
        meta["name"],
        meta["owner"],
        meta.get("text"),
        int(rate),
        np.asarray(audio, np.float32),
        float(meta["created_at"]),
    )


class SharedVoiceRegistry(VoiceRegistry):
    def __init__(self, engine: Engine, config: GatewayConfig, store: Store, prefix: str) -> None:
        super().__init__(engine, config, config.voices_dir)
        self.store = store
        self.client = store.client
        self.prefix = prefix
        self.events = f"{prefix}voices:events"
        self._deleted: set[str] = set()  # deleted here, not yet in the store
        self._tasks: set[asyncio.Task[None]] = set()

    def _item_key(self, voice_id: str) -> str:
        return f"{self.prefix}voice:{voice_id}"

    def _tombstone(self, voice_id: str) -> str:
        return f"{self.prefix}voice-deleted:{voice_id}"

    async def add(self, owner: str, name: str, text: str | None, data: bytes) -> tuple[Voice, str | None]:
        """Stored here first (the voice is usable on this replica from now on), then written
        through; a store that cannot take it now gets it at the resynchronisation after it is back."""
        voice, refusal = await super().add(owner, name, text, data)
        try:
            await self._write(voice)
            await self.client.publish(self.events, f"add {voice.voice_id}")
        except aioredis.RedisError as exc:
            log.warning(
                "voice %s is kept here; it reaches the store when it answers (%s)", voice.voice_id, exc
            )
        return voice, refusal

    async def _write(self, voice: Voice) -> None:
        # FLAC of a long clip takes tens of milliseconds: off the loop, which streams audio
        fields = await asyncio.to_thread(voice_to_redis, voice)
        with self.store.patient(WRITE_TIMEOUT_S):
            await self.client.hset(self._item_key(voice.voice_id), mapping=fields)
        await self.client.sadd(f"{self.prefix}voices", voice.voice_id)

    async def remove(self, voice_id: str) -> None:
        await super().remove(voice_id)
        self._deleted.add(voice_id)
        task = asyncio.get_running_loop().create_task(self._remove_shared(voice_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove_shared(self, voice_id: str) -> None:
        try:
            await self.client.set(self._tombstone(voice_id), b"1", ex=7 * 86400)
            await self.client.srem(f"{self.prefix}voices", voice_id)
            await self.client.delete(self._item_key(voice_id))
            await self.client.publish(self.events, f"del {voice_id}")
            self._deleted.discard(voice_id)
        except aioredis.RedisError as exc:
            log.warning("voice %s is deleted here; the store hears of it when it answers (%s)", voice_id, exc)

    async def fetch(self, voice_id: str) -> Voice | None:
        """A voice from Redis, registered with this replica's engine (a miss in the local copy)."""
        if voice_id in self._voices:
            return self._voices[voice_id]
        if not VOICE_ID.fullmatch(voice_id) or voice_id in self._deleted:
            return None
        with self.store.patient(WRITE_TIMEOUT_S):
            fields = await self.client.hgetall(self._item_key(voice_id))
        if not fields:
            return None
        try:
            voice = await asyncio.to_thread(voice_from_redis, voice_id, fields)  # off the loop, as in _write
        except (KeyError, ValueError, RuntimeError) as exc:
            log.warning("voice %s in Redis is unreadable: %s", voice_id, exc)
            return None
        await self._register(voice)
        self._voices.setdefault(voice_id, voice)
        return self._voices[voice_id]

    async def on_event(self, event: str) -> None:
        op, _, voice_id = event.partition(" ")
        if op == "add":
            await self.fetch(voice_id)
        elif op == "del":
            await self._forget(voice_id)

    async def resync(self) -> int:
        """Make the local copy match Redis: deletions made here while it was away reach it, and
        voices held here but missing there (registered while it was away, or lost by a restart
        without persistence) are written back."""
        for voice_id in list(self._deleted):
            await self._remove_shared(voice_id)
        members = {
            m.decode() if isinstance(m, bytes) else m
            for m in await self.client.smembers(f"{self.prefix}voices")
        }
        for voice_id in members - set(self._voices) - self._deleted:
            await self.fetch(voice_id)
        for voice_id in set(self._voices) - members:
            # deleted elsewhere (a tombstone says so), or not in Redis (written back from here)
            if await self.client.exists(self._tombstone(voice_id)):
                await self._forget(voice_id)
                continue
            voice = self._voices.get(voice_id)
            if voice is not None:
                await self._write(voice)
                log.info("voice %s was missing from the store: written back", voice_id)
        return len(self._voices)

    async def close(self) -> None:
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
