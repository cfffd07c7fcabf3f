"""Request bodies and client frames parsed where they cost the event loop nothing it notices.

A small one is parsed on the loop, where it takes microseconds, less than the round trip to a thread.
A large one (a one-off clone's reference clip is megabytes of base64; `max_message_bytes` may admit
large dialect frames) is parsed in a thread, so the loop that carries every session's audio does
not wait on it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sized
from typing import Final, TypeVar

INLINE_BYTES: Final = 16 * 1024  # the largest input parsed on the event loop

_In = TypeVar("_In", bound=Sized)
_Out = TypeVar("_Out")


async def off_loop_if_large(parse: Callable[[_In], _Out], raw: _In) -> _Out:
    """`parse(raw)`: on the loop up to INLINE_BYTES, in a thread beyond."""
    if len(raw) <= INLINE_BYTES:
        return parse(raw)
    return await asyncio.to_thread(parse, raw)


def _loads(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the JSON nests too deeply") from None


async def parse_json_body(raw: bytes | str) -> object:
    """`raw` as JSON (off the loop when large). Raises ValueError when it is not JSON, nesting too
    deep for the parser included."""
    return await off_loop_if_large(_loads, raw)
