"""The aligner's public face: the contract of engine.alignment.api, which aligner.qwen3 fulfils."""

from engine.alignment.api import AlignedWord, Aligner, AlignInput

__all__ = ["AlignInput", "AlignedWord", "Aligner"]
