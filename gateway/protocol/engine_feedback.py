"""The engine's side of the session protocol: a stream opened or refused, its chunks (words, then
packets: sent, or kept while the utterance is paused), its end or its failure.
"""

from __future__ import annotations

import numpy as np

from engine.api import AudioChunk, QueuePosition
from gateway.errors import error_code, public_message, retry_after_s
from gateway.messages import UtteranceQueued, UtteranceStarted
from gateway.packets import is_mono_float32
from gateway.protocol.actions import Action, Purge, SendAudio, SendControl
from gateway.protocol.fences import Fences
from gateway.protocol.utterance import RECEIVING, Status


class EngineFeedback(Fences):
    """The part of `SessionProtocol` that takes what the engine reports."""

    def open_succeeded(self, utterance_id: str, queued: QueuePosition | None = None) -> list[Action]:
        """The engine took the utterance; `queued`: it waits for admission there first."""
        utt = self._active.get(utterance_id)
        if utt is None:
            return []
        utt.opened = True
        started: UtteranceStarted = {
            "type": "utterance.started",
            "utterance_id": utterance_id,
            "stream": utt.stream,
        }
        if utt.resumed_from is not None:
            started["resumed_from"] = utt.resumed_from
            started["text_offset"] = utt.text_offset
        if queued is None:
            return [SendControl(started)]
        waiting: UtteranceQueued = {
            "type": "utterance.queued",
            "utterance_id": utterance_id,
            "position": queued.position,
            "expected_wait_ms": round(1000 * queued.expected_wait_s),
        }
        return [SendControl(started), SendControl(waiting)]

    def open_failed(self, utterance_id: str, exc: BaseException) -> list[Action]:
        """The engine refused the utterance: forget it (the id may be used again)."""
        utt = self._active.pop(utterance_id, None)
        if utt is not None:
            self._streams.pop(utt.stream, None)
            self._release_quota(utt)
        return [
            self._error(error_code(exc), public_message(exc), utterance_id, retry_after_s(exc)),
            *self._maybe_finish_session(),
        ]

    def receive_chunk(self, utterance_id: str, chunk: AudioChunk) -> list[Action]:
        utt = self._active.get(utterance_id)
        if utt is None or utt.status not in RECEIVING:
            return []  # after the fence, or after the last packet: dropped
        out: list[Action] = []
        if chunk.words:
            rate = self.engine.sample_rate
            new_words = [
                self._word(utt, w.text, w.start_sample, w.end_sample, w.char_start, w.char_end, rate)
                for w in chunk.words
            ]
            if self.timestamps == "word":
                out.append(
                    SendControl(
                        {
                            "type": "words",
                            "utterance_id": utterance_id,
                            "source": chunk.words[0].source,
                            "words": [w.to_wire() for w in new_words],
                        }
                    )
                )
        # float32, or int16 PCM (the packetiser takes either), made 1-D whichever it is: the
        # timeline below counts samples with len(), which counts rows of a (1, n) or (n, 1) array
        samples = chunk.samples
        if samples.dtype == np.int16:
            if samples.ndim != 1:
                samples = samples.reshape(-1)
        elif not is_mono_float32(samples):
            samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        gap = chunk.sample_offset - utt.engine_samples
        if gap > 0:  # the engine skipped samples: keep the timeline with silence
            samples = np.concatenate((np.zeros(gap, dtype=samples.dtype), samples))
        elif gap < 0:  # overlap with audio already sent: drop the repeated part
            samples = samples[min(-gap, len(samples)) :]
        utt.engine_samples += len(samples)
        packets = utt.packetiser.push(samples, final=chunk.final)
        if packets:
            if utt.pause is None:
                out.append(SendAudio(utt.stream, packets))
            else:
                out += self._keep(utt, packets)
        if chunk.final:
            out += self._generated(utt)
        return out

    def stream_ended(self, utterance_id: str) -> list[Action]:
        """The engine's iteration ended; finish the utterance if no final chunk came."""
        utt = self._active.get(utterance_id)
        if utt is None or utt.status not in RECEIVING:
            return []
        packets = utt.packetiser.push(np.zeros(0, np.float32), True)
        out: list[Action] = (
            [SendAudio(utt.stream, packets)] if utt.pause is None else self._keep(utt, packets)
        )
        return out + self._generated(utt)

    def stream_failed(self, utterance_id: str, exc: BaseException) -> list[Action]:
        utt = self._active.get(utterance_id)
        if utt is None:
            return []
        utt.status = Status.FAILED
        self._end_pause(utt)
        self._retire(utt)
        return [
            Purge(utt.stream),
            self._error(error_code(exc), public_message(exc), utterance_id, retry_after_s(exc)),
            *self._maybe_finish_session(),
        ]
