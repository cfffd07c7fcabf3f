"""Qwen3-ForcedAligner-0.6B inference: audio + text -> a start and an end time for every text unit
(the network: aligner.model; its slot times made non-decreasing: aligner.repair).

Batching: every input of one ``align`` call runs in one encoder pass and one decoder pass.
Feature extraction pads the batch's audio to its longest item before the STFT, as the reference's
feature extractor does, so an item's times can depend (rarely, at the 80 ms level) on its batch.
The host plans where every chunk, token and slot lies, sends those indices in one copy and reads
the slot classes back in one; nothing in between waits on the device, and the text-side work runs
while it computes.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from aligner.graphs import AlignerGraphs
from aligner.layout import DecoderLayout, chunk_bucket, encoder_output_length
from aligner.model import (
    ATTENTION_BACKENDS,
    HOP,
    SAMPLE_RATE,
    AlignerConfig,
    DecoderInputs,
    ForcedAlignerModel,
    LogMel,
)
from aligner.repair import repair_monotonic_rows
from aligner.text import UnitSplitter, display_spans, load_korean_dictionary, locate_units
from engine.alignment.api import AlignedWord, AlignInput, CallPhases

if TYPE_CHECKING:
    from tokenizers import Tokenizer

KOREAN_DICTIONARY_FILE = "korean_dict_jieba.dict"
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


# --------------------------------------------------------------------------- audio input


def to_model_audio(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """Mono float32 at 16 kHz, scaled into [-1, 1] only when its peak exceeds 1."""
    wave = np.asarray(audio, dtype=np.float32)
    if wave.ndim == 2:
        wave = (wave.T if wave.shape[0] <= 8 and wave.shape[1] > wave.shape[0] else wave).mean(axis=-1)
        wave = wave.astype(np.float32)
    if wave.ndim != 1:
        raise ValueError(f"audio must be mono (got shape {audio.shape})")
    if sample_rate != SAMPLE_RATE:
        import soxr

        wave = soxr.resample(wave, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    if wave.size:
        peak = float(np.max(np.abs(wave)))
        if peak > 1.0:
            wave = wave / peak
        wave = np.clip(wave, -1.0, 1.0)
    return wave


def model_audio(items: Sequence[tuple[np.ndarray, int]]) -> list[np.ndarray]:
    """``to_model_audio`` of every item; resampling runs on a few threads (soxr frees the GIL)."""
    if len(items) < 2 or all(rate == SAMPLE_RATE for _, rate in items):
        return [to_model_audio(audio, rate) for audio, rate in items]
    return list(_resampling_pool().map(lambda item: to_model_audio(*item), items))


@functools.cache
def _resampling_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="resample")


# --------------------------------------------------------------------------- checkpoint


REQUIRED_FILES = ("config.json", "vocab.json", "merges.txt")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in shards]
    return [directory / "model.safetensors"]


def check_checkpoint(directory: str | Path) -> Path:
    """Raise FileNotFoundError naming every file the aligner needs that ``directory`` lacks."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"aligner checkpoint directory not found: {root}")
    missing = [name for name in REQUIRED_FILES if not (root / name).is_file()]
    missing += [path.name for path in _weight_files(root) if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"aligner checkpoint {root} is missing: {', '.join(missing)}")
    return root


def load_word_tokenizer(directory: str | Path) -> Tokenizer:
    """The Qwen2 byte-level BPE from vocab.json/merges.txt (NFC, Qwen2 split regex)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    root = Path(directory)
    model = BPE.from_file(str(root / "vocab.json"), str(root / "merges.txt"))
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def load_model(
    directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ForcedAlignerModel:
    from safetensors.torch import load_file

    root = check_checkpoint(directory)
    cfg = AlignerConfig.from_json(json.loads((root / "config.json").read_text()))
    with torch.device("meta"):
        model = ForcedAlignerModel(cfg)
    expected = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(root):
        for name, tensor in load_file(str(path), device="cpu").items():
            key = name.removeprefix("thinker.")
            if key in expected:
                state[key] = tensor.to(dtype)
    missing = sorted(expected - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" … (+{len(missing) - 5})" if len(missing) > 5 else "")
        raise ValueError(f"aligner checkpoint {root} lacks tensors: {shown}")
    model.load_state_dict(state, assign=True)
    return model.to(device).eval()


# --------------------------------------------------------------------------- the aligner


_R = TypeVar("_R")
STREAM_PRIORITY = -1  # above a TTS engine's steps (0), below its first-chunk lane (the highest)


def _on_own_stream(method: Callable[..., _R]) -> Callable[..., _R]:
    """Run an aligner method with its stream current (on CUDA)."""

    @functools.wraps(method)
    def wrapper(self: Qwen3ForcedAligner, *args: Any, **kwargs: Any) -> _R:
        if self.stream is None:
            return method(self, *args, **kwargs)
        with torch.cuda.stream(self.stream):
            return method(self, *args, **kwargs)

    return wrapper


class Qwen3ForcedAligner:
    """Batched forced alignment with Qwen3-ForcedAligner weights from a local directory."""

    def __init__(
        self,
        model: ForcedAlignerModel,
        tokenizer: Tokenizer,
        splitter: UnitSplitter | None = None,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.splitter = splitter or UnitSplitter()
        self.device = model.lm_head.weight.device
        on_cuda = self.device.type == "cuda"
        self.mel = LogMel(self.device, steady=on_cuda)
        model.audio_tower.steady_shapes = on_cuda
        self.phases = CallPhases()
        self.graphs = AlignerGraphs(model.audio_tower, model) if on_cuda else None
        # Its own stream: beside a TTS engine on the same GPU, the aligner's kernels run between
        # the engine's instead of queueing behind them, and each side's wait for its results
        # waits for its own work only. Above the engine's steps in priority: a call is a long
        # chain of small kernels, each of which would otherwise wait for the engine's larger ones,
        # while its own GPU time is small.
        self.stream = torch.cuda.Stream(self.device, priority=STREAM_PRIORITY) if on_cuda else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights are in

    @classmethod
    def from_directory(
        cls,
        directory: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        korean_dictionary: str | Path | None = None,
    ) -> Qwen3ForcedAligner:
        """Load a checkpoint folder (config.json, vocab.json, merges.txt, model.safetensors[.index.json]).

        Default device: CUDA when present; default dtype: bfloat16 on CUDA, float32 elsewhere.
        Korean splitting uses ``korean_dictionary`` or ``korean_dict_jieba.dict`` in the folder;
        without either, Korean units are whole space-separated words.
        """
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model = load_model(directory, device, dtype)
        dictionary_path = Path(korean_dictionary or Path(directory) / KOREAN_DICTIONARY_FILE)
        scores = load_korean_dictionary(dictionary_path) if dictionary_path.is_file() else None
        return cls(model, load_word_tokenizer(directory), UnitSplitter(korean_dictionary=scores))

    @property
    def max_audio_s(self) -> float:
        return self.cfg.classes * self.cfg.slot_ms / 1000.0

    @_on_own_stream
    @torch.inference_mode()
    def warm_up(self, max_batch: int = 32, max_chunks: int = 1024) -> None:
        """Meet the kernels' first-use costs at start-up rather than in a caller's first batches:
        on CUDA the graphs are captured first; then batches of 1, 2, 4 … ``max_batch`` short clips
        (at 16 kHz and at a TTS engine's 24 kHz, so resampling is ready too), then with steady
        shapes the convolutions at every chunk bucket."""
        if self.graphs is not None and not len(self.graphs):
            with sdpa_kernel(ATTENTION_BACKENDS):
                self.graphs.capture()
        size = 1
        while size <= max_batch:
            rates = [(SAMPLE_RATE, 24_000)[i % 2] for i in range(size)]
            seconds = [1.5 + 0.75 * (i % 3) for i in range(size)]
            self.align(
                [
                    (np.zeros(int(rate * length), np.float32), rate, "warming up the aligner", "English")
                    for rate, length in zip(rates, seconds, strict=True)
                ]
            )
            size *= 2
        tower = self.model.audio_tower
        if not tower.steady_shapes:
            return
        dtype = self.model.lm_head.weight.dtype
        count = 1
        while count <= max_chunks:
            chunks = torch.zeros(
                (count, self.cfg.audio.num_mel_bins, tower.chunk_frames),
                device=self.device,
                dtype=dtype,
            )
            lengths = torch.zeros(count, dtype=torch.long, device=self.device)
            tower._embed_chunks(chunks, lengths, lengths == 0, True)
            count = chunk_bucket(count + 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prompt_ids(self, words: Sequence[str], audio_tokens: int) -> list[int]:
        return self.prompt_rows([words], [audio_tokens])[0]

    def prompt_rows(self, words: Sequence[Sequence[str]], audio_tokens: Sequence[int]) -> list[list[int]]:
        """Every item's prompt ids; the whole batch's units go through the tokenizer in one call."""
        cfg = self.cfg
        units = [unit for item in words for unit in item]
        pieces = iter(self.tokenizer.encode_batch(units, add_special_tokens=False) if units else [])
        slot_pair = [cfg.timestamp_token_id, cfg.timestamp_token_id]
        rows: list[list[int]] = []
        for item, count in zip(words, audio_tokens, strict=True):
            row = [cfg.audio_start_token_id, *([cfg.audio_token_id] * count), cfg.audio_end_token_id]
            for _ in item:
                row += next(pieces).ids
                row += slot_pair
            if not item:
                row += slot_pair
            rows.append(row)
        return rows

    def _launch(
        self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]
    ) -> tuple[torch.Tensor, list[int]]:
        """Queue both model passes; return the slot classes (still on the device) and slots per item."""
        features, frame_counts = self.mel(waves)
        prompts = self.prompt_rows(words, [int(encoder_output_length(frames)) for frames in frame_counts])
        layout = DecoderLayout.plan(
            prompts,
            self.cfg.audio_token_id,
            self.cfg.timestamp_token_id,
            self.model.audio_tower.steady_shapes,
        )
        graphs = self.graphs
        classes = self.model.slot_classes(
            DecoderInputs.upload(layout, self.device),
            features,
            frame_counts,
            graphs.attend if graphs else None,
            graphs.decode if graphs else None,
        )
        return classes, layout.slots

    def _repaired(self, classes: torch.Tensor, slots: list[int]) -> list[list[int]]:
        flat = (classes.numpy() * self.cfg.slot_ms).tolist()
        ends = np.cumsum(slots).tolist()
        return repair_monotonic_rows(
            [flat[end - count : end] for count, end in zip(slots, ends, strict=True)]
        )

    @_on_own_stream
    @torch.inference_mode()
    def slot_classes(self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]) -> list[int]:
        """Every slot's class before repair, item after item."""
        return self._launch(waves, words)[0].tolist()

    @_on_own_stream
    @torch.inference_mode()
    def slot_times_ms(self, waves: Sequence[np.ndarray], words: Sequence[Sequence[str]]) -> list[list[int]]:
        """Repaired slot times in ms for 16 kHz waves and their unit lists (two slots per unit)."""
        classes, slots = self._launch(waves, words)
        return self._repaired(classes.cpu(), slots)  # the batch's one wait on the device

    @_on_own_stream
    @torch.inference_mode()
    def submit(self, batch: Sequence[AlignInput]) -> QueuedCall:
        """Ready a batch and queue its device work, its slot classes' copy to the host included;
        nothing here waits on the device, so the next batch can be readied while this one runs."""
        began = time.perf_counter()
        waves = model_audio([(audio, rate) for audio, rate, _, _ in batch])
        for wave in waves:
            if len(wave) / SAMPLE_RATE > self.max_audio_s:
                raise ValueError(
                    f"aligner input is {len(wave) / SAMPLE_RATE:.1f} s; the limit is {self.max_audio_s:.0f} s"
                )
            if len(wave) < HOP:
                raise ValueError("aligner input is shorter than 10 ms")
        words = [self.splitter.words(text, language) for _, _, text, language in batch]
        classes, slots = self._launch(waves, words) if batch else (torch.zeros(0, dtype=torch.long), [])
        done: torch.cuda.Event | None = None
        if classes.device.type == "cuda":
            host = torch.empty(classes.shape, dtype=classes.dtype, pin_memory=True)
            host.copy_(classes, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            classes = host
        # While the device works: where every unit lies in the client's text.
        spans = [
            display_spans(text, locate_units(text, units))
            for (_, _, text, _), units in zip(batch, words, strict=True)
        ]
        return QueuedCall(list(batch), spans, classes, slots, done, time.perf_counter() - began)

    def collect(self, call: QueuedCall) -> list[list[AlignedWord]]:
        """The words of a submitted batch, once its device work is done."""
        waited = time.perf_counter()
        call.wait()
        read = time.perf_counter()
        times = self._repaired(call.classes, call.slots)
        aligned = [
            [
                AlignedWord(
                    text=text[start:end],
                    start_s=round(slot_ms[2 * i] / 1000.0, 3),
                    end_s=round(slot_ms[2 * i + 1] / 1000.0, 3),
                    char_start=start,
                    char_end=end,
                )
                for i, (start, end) in enumerate(item_spans)
            ]
            for (_, _, text, _), item_spans, slot_ms in zip(call.batch, call.spans, times, strict=True)
        ]
        self.phases.add(call.prepare_s, read - waited, time.perf_counter() - read)
        return aligned

    def align(self, batch: Sequence[AlignInput]) -> list[list[AlignedWord]]:
        if not batch:
            return []
        return self.collect(self.submit(batch))


@dataclass(slots=True)
class QueuedCall:
    """A submitted batch: its inputs, every unit's place in its text, the slot classes (on the host
    once `done` has passed) and each item's slot count."""

    batch: list[AlignInput]
    spans: list[list[tuple[int, int]]]
    classes: torch.Tensor
    slots: list[int]
    done: torch.cuda.Event | None  # recorded behind the classes' copy to the host (CUDA only)
    prepare_s: float

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
