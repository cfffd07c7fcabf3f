"""The cluster's directory wrapper of a stream passes the word-alignment mode and the queue position on and is iterated (its
end is what removes the directory entry), without Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.api import AudioChunk, QueuePosition, SynthesisStream, TextSegment
from gateway.cluster.state import _DirectoryStream


class Inner(SynthesisStream):
    def __init__(self) -> None:
        self.request_id = "s/u"
        self.modes: list[str] = []

    def push(self, segment: TextSegment) -> None: ...

    def close_text(self) -> None: ...

    def cancel(self) -> None: ...

    def listen(self, listener: object) -> bool:
        raise AssertionError("the wrapper must iterate its inner stream")

    def set_word_alignment(self, mode: str) -> None:
        self.modes.append(mode)

    def queue_position(self) -> QueuePosition | None:
        return QueuePosition(position=3, expected_wait_s=1.5)

    def queue_wait_s(self) -> float:
        return 0.25

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        if False:
            yield


def test_the_word_alignment_mode_reaches_the_wrapped_stream_and_listening_is_declined() -> None:
    inner = Inner()
    wrapped = _DirectoryStream(inner, cluster=None, key="directory:s/u")  # type: ignore[arg-type]
    wrapped.set_word_alignment("sync")
    assert inner.modes == ["sync"]
    assert wrapped.listen(object()) is False  # type: ignore[arg-type]


def test_the_queue_position_and_wait_are_the_inner_streams() -> None:
    wrapper = _DirectoryStream(Inner(), None, "k")  # type: ignore[arg-type]
    assert wrapper.queue_position() == QueuePosition(position=3, expected_wait_s=1.5)
    assert wrapper.queue_wait_s() == 0.25
