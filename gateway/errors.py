"""How each failure shows on the wire.

Two kinds of outcome: an `error` message (the session goes on) carrying an error code, or the end
of the socket with a WebSocket close code. `ProtocolError` (gateway.messages) is the first kind for
bad client input; engine errors (engine.api) map to codes by their `code` attribute.
"""

from __future__ import annotations

from typing import Final, get_args

from engine.api import EngineError, Overloaded
from gateway.messages import ErrorCode, ProtocolError

# WebSocket close codes the gateway sends (RFC 6455 section 7.4.1)
CLOSE_NORMAL: Final = 1000
CLOSE_GOING_AWAY: Final = 1001  # the server is shutting down
CLOSE_POLICY: Final = 1008  # bad token, or a client too slow
CLOSE_TOO_BIG: Final = 1009  # a frame over max_message_bytes


def error_code(exc: BaseException) -> ErrorCode:
    """The protocol error code for any exception (unknown failures are `internal`)."""
    if isinstance(exc, ProtocolError):
        return exc.code
    if isinstance(exc, EngineError):
        code = getattr(exc, "code", "internal")
        for known in get_args(ErrorCode):
            if code == known:
                return known  # type: ignore[no-any-return]
        return "internal"
    return "internal"


def public_message(exc: BaseException) -> str:
    """What the client may read about a failure (internal details are not leaked)."""
    if isinstance(exc, ProtocolError):
        return exc.message
    if isinstance(exc, EngineError):
        return str(exc) or exc.__class__.__name__
    return "internal error"


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds to wait before retrying, for an overloaded engine."""
    if isinstance(exc, Overloaded):
        return max(0.0, exc.retry_after_s)
    return None
