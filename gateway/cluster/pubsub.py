"""A Redis pub/sub subscription that outlives connection losses: subscribe, hand every message to a
synchronous callback in arrival order, and on a Redis error resubscribe after a short pause."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

log = logging.getLogger(__name__)


async def listen_forever(
    client: aioredis.Redis,
    channels: Sequence[str],
    on_message: Callable[[str, bytes], None],
    subscribed: asyncio.Event,
    name: str,
) -> None:
    """on_message(channel, data) for each message, until cancelled; `subscribed` is set once the
    first subscription is in place."""
    while True:
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(*channels)
            subscribed.set()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    on_message(message["channel"].decode(), message["data"])
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            raise
        except (aioredis.RedisError, OSError, ValueError) as exc:
            log.warning("%s subscription lost (%s); resubscribing", name, exc)
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(0.2)
