"""The voice alias table: OpenAI names on the engine's presets, a file's aliases on top."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.api import EngineInfo
from gateway.compat.voices import DEFAULT_ALIASES, OPENAI_VOICES, VoiceAliasError, VoiceAliases

QWEN = EngineInfo(
    "qwen3",
    "qwen3-tts",
    24000,
    voices=("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee"),
)
FAKE = EngineInfo("fake", "tones", 24000, voices=("alice", "bob"), default_voice="alice")


def test_every_openai_voice_has_a_qwen3_speaker() -> None:
    aliases = VoiceAliases()
    assert set(DEFAULT_ALIASES) == set(OPENAI_VOICES)
    resolved = {name: aliases.resolve(name, QWEN) for name in OPENAI_VOICES}
    assert all(v in QWEN.voices for v in resolved.values()), resolved  # the engine's own spelling
    assert resolved["onyx"] == "uncle_fu" and resolved["alloy"] == "vivian"


def test_engine_names_pass_through_and_unknown_openai_targets_mean_the_default() -> None:
    aliases = VoiceAliases()
    assert aliases.resolve("Bob", FAKE) == "bob"
    assert aliases.resolve("alloy", FAKE) is None  # Vivian is not a fake voice: the engine's default
    assert aliases.resolve(None, FAKE) is None and aliases.resolve("default", FAKE) is None
    assert aliases.resolve("v_123abc", FAKE) == "v_123abc"  # a registered voice id


def test_a_file_overrides_and_extends(tmp_path: Path) -> None:
    path = tmp_path / "aliases.json"
    path.write_text(json.dumps({"alloy": "BOB", "pNInz6obpgDQGcFmaJgB": "alice", "sonic": "nobody"}))
    aliases = VoiceAliases.load(str(path))
    assert aliases.resolve("alloy", FAKE) == "bob"
    assert aliases.resolve("pNInz6obpgDQGcFmaJgB", FAKE) == "alice"
    assert aliases.resolve("sonic", FAKE) == "nobody"  # an explicit wrong target is the engine's to refuse
    assert aliases.table()["alloy"] == "BOB" and aliases.table()["onyx"] == "Uncle_Fu"


def test_the_environment_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.json"
    path.write_text('{"nova": "bob"}')
    monkeypatch.setenv("CADENCE_VOICE_ALIASES", str(path))
    assert VoiceAliases.load().resolve("nova", FAKE) == "bob"


@pytest.mark.parametrize("content", ["[1, 2]", '{"a": 3}', "{nope", '{"": "x"}'])
def test_a_bad_file_is_refused_clearly(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(VoiceAliasError, match="bad.json"):
        VoiceAliases.load(str(path))
    with pytest.raises(VoiceAliasError, match="missing.json"):
        VoiceAliases.load(str(tmp_path / "missing.json"))
