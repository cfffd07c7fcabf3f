"""A session protocol under a key's quotas, driven without a socket: what the quota tests share."""

from __future__ import annotations

import json
from typing import Any

from gateway.config import GatewayConfig
from gateway.protocol import OpenStream, SendControl, SessionProtocol
from gateway.quotas import Quotas
from tests.fakes import FakeEngine


def quota_protocol(quotas: Quotas, **config: Any) -> SessionProtocol:
    """Session "s" of key "k" under `quotas`."""
    return SessionProtocol("s", FakeEngine().info, GatewayConfig(**config), key_id="k", quotas=quotas)


def append(uid: str, text: str) -> str:
    return json.dumps({"type": "speak.append", "utterance_id": uid, "text": text})


def errors(actions: list[Any]) -> list[Any]:
    """The `error` messages among a step's actions."""
    return [a.message for a in actions if isinstance(a, SendControl) and a.message["type"] == "error"]


def opened(actions: list[Any]) -> bool:
    """Whether the step opened an engine stream."""
    return any(isinstance(a, OpenStream) for a in actions)
