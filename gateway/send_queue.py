"""A session's send queue: two lanes, control messages ahead of audio; the audio lane bounded by
high/low watermarks, purged or taken back per stream (a fence, a pause).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gateway.packets import Packet


@dataclass(frozen=True, slots=True)
class CloseItem:
    """A close in the control lane: the writer task closes the socket once what is before it is sent."""

    code: int
    reason: str


class TrailerItem:
    """A JSON message in the audio lane, after its stream's queued packets (utterance.done)."""

    __slots__ = ("stream", "text")

    def __init__(self, stream: int, text: str) -> None:
        self.stream = stream
        self.text = text


# An audio-lane entry: a packet (it knows its stream) or a trailer. Packets are held as they are,
# with no wrapper: paced packets wait seconds in the lane, and every object that waits that long
# is walked by each young collection, whose pause every stream waits through
AudioItem = Packet | TrailerItem


def _ignore_news() -> None:
    pass


class SendQueue:
    """Control messages ahead of audio; audio bounded by high/low watermarks (in items).
    `on_news` is called whenever something is added or purged."""

    def __init__(self, high: int, low: int, on_news: Callable[[], None]) -> None:
        self.high = high
        self.low = low
        self.control: deque[str | CloseItem] = deque()
        self.audio: deque[AudioItem] = deque()
        self.writable = asyncio.Event()  # producers may add audio
        self.writable.set()
        self._news = on_news

    def put_control(self, item: str | CloseItem) -> None:
        self.control.append(item)
        self._news()

    def put_audio(self, packets: list[Packet]) -> None:
        self.audio.extend(packets)
        if len(self.audio) >= self.high:
            self.writable.clear()
        self._news()

    def put_trailer(self, stream: int, text: str) -> None:
        self.audio.append(TrailerItem(stream, text))
        if len(self.audio) >= self.high:
            self.writable.clear()
        self._news()

    def queued_bytes(self) -> int:
        """Memory held by queued frames (payloads and JSON text), for /metrics."""
        total = sum(len(c) if isinstance(c, str) else 0 for c in self.control)
        for item in self.audio:
            total += len(item.text) if isinstance(item, TrailerItem) else len(item.frame)
        return total

    def purge(self, stream: int) -> int:
        before = len(self.audio)
        kept = [a for a in self.audio if a.stream != stream]
        self.audio.clear()  # in place: a pump in progress holds this deque
        self.audio.extend(kept)
        self.after_take()
        self._news()
        return before - len(self.audio)

    def withdraw(self, stream: int) -> tuple[list[Packet], bool]:
        """Take this stream's queued packets back, in order (a pause), and say whether its trailer
        was queued too (it is dropped: the protocol sends it again later)."""
        taken = [a for a in self.audio if a.stream == stream]
        if taken:
            self.purge(stream)
        packets = [a for a in taken if isinstance(a, Packet)]
        return packets, len(packets) < len(taken)

    def after_take(self) -> None:
        """Audio was taken off the lane: producers may resume."""
        if len(self.audio) <= self.low:
            self.writable.set()

    def detach(self) -> None:
        """No more news: `on_news` (a callback holding the session) is dropped, which ends the
        session <-> queue reference cycle, so a closed session is freed at once rather than left
        for a full collection (whose pause every stream in the process waits through)."""
        self._news = _ignore_news
