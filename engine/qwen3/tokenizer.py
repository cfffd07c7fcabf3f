"""Qwen2 byte-level BPE text tokenizer (vocab.json + merges.txt + tokenizer_config.json), built on
the `tokenizers` library, with the ChatML special tokens (`<|im_start|>`, `<|im_end|>`, the tts
pad/bos/eos tokens) matched verbatim before BPE, as the Qwen2 fast tokenizer does."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# Qwen2's pre-tokenisation split.
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# The split transformers 4.57.3 substitutes when a tokenizer is loaded with fix_mistral_regex=True
# from a local directory whose config.json names a transformers version in (4.57.2, 5.0) (the
# reference wrapper passes that flag). It differs from QWEN2_PATTERN only on case changes inside a
# word ("CamelCase") and on "/" after punctuation.
MISTRAL_FIX_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

REQUIRED_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


class TextTokenizer:
    def __init__(self, bpe: Tokenizer, special_tokens: dict[str, int]) -> None:
        self._bpe = bpe
        self.special_tokens = dict(special_tokens)
        self._id_to_special = {v: k for k, v in special_tokens.items()}
        alternatives = sorted(special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in alternatives)) if alternatives else None

    @classmethod
    def from_dir(cls, path: str | Path, pattern: str = QWEN2_PATTERN) -> TextTokenizer:
        path = Path(path)
        missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"tokenizer files missing in {path}: {', '.join(missing)}")
        with open(path / "vocab.json", encoding="utf-8") as f:
            vocab: dict[str, int] = json.load(f)
        merges: list[tuple[str, str]] = []
        with open(path / "merges.txt", encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line or line.startswith("#version"):
                    continue
                left, right = line.split(" ")
                merges.append((left, right))
        with open(path / "tokenizer_config.json", encoding="utf-8") as f:
            tok_cfg = json.load(f)
        special = {
            entry["content"]: int(token_id)
            for token_id, entry in tok_cfg.get("added_tokens_decoder", {}).items()
        }
        return cls(build_bpe(vocab, merges, pattern), special)

    def encode(self, text: str) -> list[int]:
        """Text (may contain special-token strings) -> ids; ValueError for text that is not valid
        Unicode (lone surrogates, as json.loads makes of "\\ud800" escapes), which the BPE refuses
        with a TypeError."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from None
        ids: list[int] = []
        pos = 0
        if self._special_re is not None:
            for match in self._special_re.finditer(text):
                if match.start() > pos:
                    ids += self._bpe.encode(text[pos : match.start()], add_special_tokens=False).ids
                ids.append(self.special_tokens[match.group(0)])
                pos = match.end()
        if pos < len(text):
            ids += self._bpe.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        out, run = [], []
        for i in ids:
            if i in self._id_to_special:
                if run:
                    out.append(self._bpe.decode(run, skip_special_tokens=False))
                    run = []
                out.append(self._id_to_special[i])
            else:
                run.append(i)
        if run:
            out.append(self._bpe.decode(run, skip_special_tokens=False))
        return "".join(out)

    def token_id(self, content: str) -> int:
        return self.special_tokens[content]


def build_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str = QWEN2_PATTERN
) -> Tokenizer:
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok
