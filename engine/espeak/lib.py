"""libespeak-ng through ctypes (library and data from the `espeakng-loader` wheel).

eSpeak NG keeps all its state in process globals (one voice, one callback, one text queue), so
this module holds the one process-wide instance: `library()` loads it once, and `synthesize()`
runs one call under a process-wide lock. In SYNCHRONOUS mode the callback runs inside
`espeak_Synth`, in the calling thread, with up to `BUFFER_MS` of int16 PCM and its events.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import Callable
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    Union,
    c_char,
    c_char_p,
    c_int,
    c_short,
    c_size_t,
    c_uint,
    c_void_p,
)
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
CHARS_UTF8 = 1
RATE = 1  # espeak_SetParameter's words-per-minute parameter
EVENT_WORD = 1
BUFFER_MS = 100
# what eSpeak must not see of a caller's text: NUL ends its C string, U+0001 opens an embedded
# command ("\x01300A") that changes the process-wide voice for every later call, and a lone
# surrogate has no UTF-8; each becomes one space, so event positions still index the caller's text
_UNSPEAKABLE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


class _EventId(Union):
    _fields_ = [("number", c_int), ("name", c_char_p), ("string", c_char * 8)]


class _Event(Structure):
    _fields_ = [
        ("type", c_int),
        ("unique_identifier", c_uint),
        ("text_position", c_int),
        ("length", c_int),
        ("audio_position", c_int),
        ("sample", c_int),
        ("user_data", c_void_p),
        ("id", _EventId),
    ]


_Callback = CFUNCTYPE(c_int, POINTER(c_short), c_int, POINTER(_Event))


@dataclass(frozen=True, slots=True)
class WordEvent:
    position: int  # 0-based code-point index into the call's text
    ms: int  # from the start of this call's audio


# handler(pcm int16, word events) -> True to abort the call
ChunkHandler = Callable[[npt.NDArray[np.int16], list[WordEvent]], bool]


class EspeakError(RuntimeError):
    pass


class Espeak:
    """The process's eSpeak NG; use `library()`."""

    def __init__(self) -> None:
        lib_path, data_path = _locate()
        lib = ctypes.CDLL(lib_path)
        lib.espeak_Initialize.argtypes = [c_int, c_int, c_char_p, c_int]
        lib.espeak_Initialize.restype = c_int
        lib.espeak_SetSynthCallback.argtypes = [_Callback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_Synth.argtypes = [
            c_void_p,
            c_size_t,
            c_uint,
            c_int,
            c_uint,
            c_uint,
            POINTER(c_uint),
            c_void_p,
        ]
        lib.espeak_Synth.restype = c_int
        lib.espeak_SetVoiceByName.argtypes = [c_char_p]
        lib.espeak_SetVoiceByName.restype = c_int
        lib.espeak_SetParameter.argtypes = [c_int, c_int, c_int]
        lib.espeak_SetParameter.restype = c_int
        lib.espeak_Info.argtypes = [POINTER(c_char_p)]
        lib.espeak_Info.restype = c_char_p
        rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS, data_path.encode(), 0)
        if rate <= 0:
            raise EspeakError("espeak_Initialize failed")
        self._lib = lib
        self.sample_rate: int = rate
        self.version: str = (lib.espeak_Info(None) or b"").decode()
        self.data_path = data_path
        self._callback = _Callback(self._on_chunk)  # keep a reference for the C side
        lib.espeak_SetSynthCallback(self._callback)
        self._handler: ChunkHandler | None = None
        self._error: BaseException | None = None
        self._voice: str | None = None
        self._languages: dict[str, str] | None = None

    def languages(self) -> dict[str, str]:
        """Language codes of the data files that speak, lower case -> as eSpeak spells them (en-US,
        cmn ...); a language whose dictionary the data lacks (fo, kaa) would speak silence."""
        if self._languages is None:
            root = Path(self.data_path)
            self._languages = {
                p.name.lower(): p.name
                for p in (root / "lang").rglob("*")
                if p.is_file() and (root / f"{_dictionary(p)}_dict").is_file()
            }
        return self._languages

    def synthesize(self, text: str, voice: str, rate_wpm: int, handler: ChunkHandler) -> None:
        """Speak `text`, streaming chunks into `handler` (in this thread) until done or aborted."""
        data = _UNSPEAKABLE.sub(" ", text).encode("utf-8") + b"\0"
        with _LOCK:
            if voice != self._voice:
                if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
                    self._voice = None
                    raise EspeakError(f"eSpeak voice {voice!r} not found")
                self._voice = voice
            self._lib.espeak_SetParameter(RATE, rate_wpm, 0)
            self._handler, self._error = handler, None
            try:
                rc = self._lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
            finally:
                self._handler, error = None, self._error
        if error is not None:
            raise error
        if rc != 0:
            raise EspeakError(f"espeak_Synth returned {rc}")

    def _on_chunk(self, wav: ctypes._Pointer[c_short], count: int, events: ctypes._Pointer[_Event]) -> int:
        handler = self._handler
        if handler is None:
            return 1
        pcm = np.frombuffer(ctypes.string_at(wav, 2 * count), np.int16) if wav and count > 0 else _EMPTY
        words: list[WordEvent] = []
        i = 0
        while events[i].type != 0:
            event = events[i]
            if event.type == EVENT_WORD:
                words.append(WordEvent(event.text_position - 1, event.audio_position))
            i += 1
        try:
            return 1 if handler(pcm, words) else 0
        except BaseException as exc:  # never unwind through C: stop, re-raise after the call
            self._error = exc
            return 1


_EMPTY: npt.NDArray[np.int16] = np.zeros(0, np.int16)
_LOCK = threading.RLock()
_INSTANCE: Espeak | None = None


def library() -> Espeak:
    """The process's eSpeak instance, loaded on first use."""
    global _INSTANCE
    with _LOCK:
        if _INSTANCE is None:
            _INSTANCE = Espeak()
        return _INSTANCE


def _dictionary(lang_file: Path) -> str:
    """The dictionary a language data file loads: its `dictionary`, else its first language's
    code up to the first hyphen (pt-br -> pt), as eSpeak picks it."""
    dictionary = language = None
    for line in lang_file.read_text("utf-8", errors="replace").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "dictionary":
            dictionary = dictionary or words[1]
        elif len(words) >= 2 and words[0] == "language":
            language = language or words[1]
    return dictionary or (language or lang_file.name).split("-")[0]


def _locate() -> tuple[str, str]:
    lib, data = os.environ.get("ESPEAK_LIB"), os.environ.get("ESPEAK_DATA")
    if lib and data:
        return lib, data
    import espeakng_loader

    return str(espeakng_loader.get_library_path()), str(espeakng_loader.get_data_path())
