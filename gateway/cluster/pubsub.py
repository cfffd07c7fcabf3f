"""A Redis pub/sub subscription that outlives outages of the store: subscribe, hand every message to
a synchronous callback in arrival order, and when the connection is lost open the store's breaker
and subscribe again once it closes; a subscription answered with an error is tried again too. The
loss is logged once per outage, and so is the return."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from gateway.cluster.store import Store, delivering_cancellation, is_outage

log = logging.getLogger("cadence.redis")


async def listen_forever(
    store: Store,
    channels: Sequence[str],
    on_message: Callable[[str, bytes], None],
    subscribed: asyncio.Event,
    name: str,
) -> None:
    """on_message(channel, data) for each message, until cancelled; `subscribed` is set once the
    first subscription is in place."""
    lost = False
    while True:
        await store.wait_up()
        pubsub = store.client.pubsub()
        try:
            with delivering_cancellation():  # SUBSCRIBE is written as every command is
                async with asyncio.timeout(store.timeout_s):
                    await pubsub.subscribe(*channels)
            subscribed.set()
            if lost:
                lost = False
                log.warning("%s subscription restored", name)
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                try:
                    on_message(message["channel"].decode(), message["data"])
                except Exception:  # one bad message must not end the subscription
                    log.exception("%s: a message could not be handled", name)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
            raise
        except Exception as exc:
            # an error answer (BUSY: a long script; a refused SUBSCRIBE) ends this subscription
            # as an outage does and must not end the listener, which subscribes again after the
            # pause below. It leaves the breaker to the probe (a busy store fails PING too): an
            # error of SUBSCRIBE alone must not take the store from every other command.
            if not lost:
                lost = True
                log.warning("%s subscription lost (%s); subscribing again when the store answers", name, exc)
            if is_outage(exc):
                store.trip(exc)
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
            await asyncio.sleep(store.probe_s)  # a store that answers PING but refuses SUBSCRIBE
