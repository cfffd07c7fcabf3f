"""Other vendors' dialects, each a thin translation onto the native session (gateway.compat.bridge):
OpenAI's speech endpoint (gateway.rest), ElevenLabs', Cartesia's and vLLM-Omni's streaming
WebSockets. docs/compat.md says what each supports."""

from __future__ import annotations

from starlette.routing import BaseRoute

from gateway.compat.bridge import Compat
from gateway.compat.cartesia import CartesiaEndpoints
from gateway.compat.elevenlabs import ElevenLabsEndpoints
from gateway.compat.vllm_omni import VllmOmniEndpoints

__all__ = ["Compat", "compat_routes"]


def compat_routes(compat: Compat) -> list[BaseRoute]:
    return [
        *ElevenLabsEndpoints(compat).routes(),
        *CartesiaEndpoints(compat).routes(),
        *VllmOmniEndpoints(compat).routes(),
    ]
