"""Voice names of other vendors -> the engine's voices, through one table shared by every dialect.

The default table gives each of OpenAI's voice names one of Qwen3-TTS's CustomVoice speakers
(which the qwen3 engine, the espeak engine and a vLLM-Omni CustomVoice server all offer), women's
voices for women's, men's for men's. A JSON file of `{"name": "engine voice", ...}` adds to it or
overrides it: any foreign voice id can be listed there (an ElevenLabs voice id, a Cartesia UUID).
Its path comes from `GatewayConfig.voice_aliases_file`, else from CADENCE_VOICE_ALIASES.

Resolution: a name the engine knows (its presets, matched without regard to case) is used as it
is; an alias goes to its target; a default alias whose target this engine lacks, and an OpenAI
name with no alias, mean the engine's default voice; anything else passes through unchanged (a
registered voice id, or a name the engine will refuse with `unknown_voice`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from engine.api import EngineInfo

ENV_VAR: Final = "CADENCE_VOICE_ALIASES"
OPENAI_VOICES: Final = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
# OpenAI's voices on Qwen3-TTS's CustomVoice speakers
DEFAULT_ALIASES: Final[Mapping[str, str]] = {
    "alloy": "Vivian",
    "ash": "Ryan",
    "ballad": "Aiden",
    "coral": "Serena",
    "echo": "Eric",
    "fable": "Dylan",
    "nova": "Vivian",
    "onyx": "Uncle_Fu",
    "sage": "Serena",
    "shimmer": "Sohee",
    "verse": "Aiden",
    "marin": "Ono_Anna",
    "cedar": "Ryan",
}


class VoiceAliasError(ValueError):
    """The aliases file is missing or not a JSON object of names to names."""


@dataclass(frozen=True)
class VoiceAliases:
    extra: Mapping[str, str] = field(default_factory=dict)  # from the file: they win

    @classmethod
    def load(cls, path: str | None = None) -> VoiceAliases:
        path = path or os.environ.get(ENV_VAR) or None
        if path is None:
            return cls()
        try:
            table = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise VoiceAliasError(f"voice aliases file {path}: {exc}") from None
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v for k, v in table.items()
        ):
            raise VoiceAliasError(f"voice aliases file {path}: expected a JSON object of names to names")
        return cls(dict(table))

    def table(self) -> dict[str, str]:
        """Every alias in force (the defaults, then the file's)."""
        return {**DEFAULT_ALIASES, **self.extra}

    def resolve(self, name: str | None, engine: EngineInfo) -> str | None:
        """The engine voice for `name`; None = the engine's default voice."""
        if name is None or name == "default":
            return None
        known = _preset(name, engine)
        if known is not None:
            return known
        if name in self.extra:
            target = self.extra[name]
            return _preset(target, engine) or target
        default = DEFAULT_ALIASES.get(name) or DEFAULT_ALIASES.get(name.lower())
        if default is not None:
            return _preset(default, engine)
        if name.lower() in OPENAI_VOICES:
            return None
        return name


def _preset(name: str, engine: EngineInfo) -> str | None:
    if name in engine.voices:
        return name
    lowered = name.lower()
    return next((v for v in engine.voices if v.lower() == lowered), None)
