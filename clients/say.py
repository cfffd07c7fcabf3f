"""`cadence say "text" -o out.wav --words`: speak a text through a running gateway into a WAV file."""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import wave
from pathlib import Path
from typing import TextIO

import websockets

from clients.client import ClientError, Done, Error, Interrupted, Packet, Queued, Words, connect
from gateway.messages import Word

DEFAULT_URL = "ws://127.0.0.1:8000/v1/stream"
# names a reader takes for another format by their suffix: WAV bytes in them would not play there
OTHER_FORMATS = frozenset(".mp3 .flac .opus .ogg .oga .aac .m4a .mp4 .webm .aiff .aif .pcm .raw".split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence say", description="Speak a text into a WAV file.")
    parser.add_argument("text", help="the text to speak ('-' reads standard input)")
    parser.add_argument(
        "-o",
        "--output",
        default="out.wav",
        help="WAV file to write, '-' for standard output (default out.wav)",
    )
    parser.add_argument("--words", action="store_true", help="print each word with its start and end time")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"gateway stream endpoint (default {DEFAULT_URL})")
    parser.add_argument("--voice", default=None, help="a preset or registered voice id")
    parser.add_argument("--language", default=None, help='e.g. "English", "Chinese" or "Auto"')
    parser.add_argument("--instructions", default=None, help="style instruction, where the engine takes one")
    parser.add_argument("--sample-rate", type=int, default=None, help="output rate (default: the server's)")
    parser.add_argument("--token", default=None, help="bearer token, when the gateway has keys")
    return parser


async def say(args: argparse.Namespace, out: TextIO) -> int:
    pcm = bytearray()
    words: list[Word] = []
    async with connect(
        args.url,
        voice=args.voice,
        language=args.language,
        instructions=args.instructions,
        encoding="pcm_s16le",
        sample_rate=args.sample_rate,
        token=args.token,
    ) as session:
        async for event in session.speak(args.text):
            if isinstance(event, Packet):
                at = event.sample_offset * 2  # place by offset: a gap would stay silent
                if at > len(pcm):
                    pcm += bytes(at - len(pcm))
                pcm[at : at + len(event.payload)] = event.payload
            elif isinstance(event, Words):
                words.extend(event.words)
                if args.words:
                    for word in event.words:
                        line = f"{word.start_ms / 1000:8.3f} {word.end_ms / 1000:8.3f}  {word.text}"
                        print(line, file=sys.stderr if args.output == "-" else out)
            elif isinstance(event, Queued):
                wait = f"about {event.expected_wait_ms / 1000:.1f} s"
                print(
                    f"queued: the server is at capacity, position {event.position}, {wait}", file=sys.stderr
                )
            elif isinstance(event, Error):
                retry = f" (retry after {event.retry_after_ms / 1000:.1f} s)" if event.retry_after_ms else ""
                print(f"error: {event.code}: {event.message}{retry}", file=sys.stderr)
                return 1
            elif isinstance(event, Interrupted):
                print("error: the utterance was interrupted", file=sys.stderr)
                return 1
            elif isinstance(event, Done):
                break
        rate = session.sample_rate
    data = io.BytesIO()
    with wave.open(data, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(bytes(pcm))
    write_output(args.output, data.getvalue())  # the session is closed: nothing else waits on the loop
    seconds = len(pcm) / 2 / rate
    where = "standard output" if args.output == "-" else args.output
    print(f"wrote {where}: {seconds:.2f} s at {rate} Hz, {len(words)} words", file=sys.stderr)
    return 0


def write_output(output: str, data: bytes) -> None:
    """The WAV into the file named, or onto standard output for `-`."""
    if output == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        Path(output).write_bytes(data)


def say_main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if Path(args.output).suffix.lower() in OTHER_FORMATS:
        parser.error(
            f"-o {args.output}: cadence say writes WAV only (name the file .wav, or - for standard "
            "output); for mp3, opus, aac or flac ask POST /v1/audio/speech for its response_format"
        )
    try:
        if args.text == "-":
            args.text = sys.stdin.read()
        if not args.text.strip():
            parser.error("nothing to say: the text is empty")
        return asyncio.run(say(args, out or sys.stdout))
    except KeyboardInterrupt:
        print("cadence say: interrupted; nothing written", file=sys.stderr)
        return 130
    except (ClientError, OSError, websockets.WebSocketException) as exc:
        print(failure(exc, args.url), file=sys.stderr)
        return 2


def failure(exc: BaseException, url: str) -> str:
    """What went wrong on the way to the gateway, as the user can act on it."""
    if _refused(exc):
        return (
            f"error: no gateway is listening at {url}\n"
            "start one in another shell with `cadence serve` (or `scripts/serve` in a checkout), "
            "or point --url at a running one"
        )
    if isinstance(exc, websockets.InvalidStatus):
        # the stream endpoint upgrades whatever the credentials; another path answers a status
        return (
            f"error: {url} answered HTTP {exc.response.status_code}, not a WebSocket: is it the "
            "gateway's stream endpoint, such as ws://127.0.0.1:8000/v1/stream?"
        )
    if isinstance(exc, websockets.ConnectionClosed) and exc.rcvd is not None and exc.rcvd.code == 1008:
        return f"error: the gateway refused the credentials ({exc.rcvd.reason}); pass a key or token with --token"
    return f"error: {exc}"


def _refused(exc: BaseException) -> bool:
    """A connection nobody accepted: refused on the one address, or on every address of the host."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    text = str(exc)
    return type(exc) is OSError and text.startswith("Multiple exceptions") and "Connect call failed" in text


if __name__ == "__main__":
    raise SystemExit(say_main())
