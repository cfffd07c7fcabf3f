"""Segment joins on the embedded Qwen3 engine: is the next segment's first audio ready before
real-time playback of what came before runs out, and does the engine add audio of its own at joins?

    python bench/gpu_segment_joins.py --out deploy/bench/h200-segment-joins-1.7b.json   # H200
    python bench/gpu_segment_joins.py --model checkpoints/qwen3-1.7b-random --out joins.json  # kept, reused
    python bench/gpu_segment_joins.py --size tiny --device cpu --concurrency 1,4 --out joins.json

Random weights at the real shapes (a checkpoint is written when --model is absent), so the figure is
about timing, not sound. Paragraph-length texts of the benchmark corpus are cut by the gateway's own
segmenter (gateway.segmenter.UtteranceText, the gateway's default limits) and pushed as several
segments with a forced length (the row's frames, capped at --max-frames), which the engine shares
over the segments by characters. For each concurrency N, N workers run utterances back to back in a
closed loop, starting new ones for --seconds; any still open at --level-timeout are cancelled.

Per utterance, each audio chunk's lateness is its arrival minus the moment real-time playback from the
first chunk reaches its first sample (negative: early). A join chunk is the chunk holding a segment's
first sample; segment starts come from the engine's word timings (a finished segment's words span
exactly its frames), for a segment not finished (cancelled) from the forced frames as shared. Reported per concurrency: joins
measured, lateness at joins and at every other chunk (first chunks excluded) p50/p90/max and the
fraction late by more than 0 / 20 / 80 ms, the rise in lateness from the previous chunk, and the
audio-length check of completed utterances (samples == forced frames x samples per frame, a
contiguous timeline: zero inserted samples).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.api import Overloaded, SynthesisRequest, TextSegment, WordTiming  # noqa: E402
from engine.qwen3.engine import Qwen3Engine, Qwen3EngineConfig, Qwen3Stream, share_frames  # noqa: E402
from engine.qwen3.request import SAMPLE_RATE, SAMPLES_PER_FRAME  # noqa: E402
from engine.qwen3.runner import RunnerConfig  # noqa: E402
from engine.qwen3.scheduler import SchedulerConfig  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.segmenter import UtteranceText  # noqa: E402

CORPUS = ROOT / "deploy" / "bench" / "corpus.jsonl"
LANGUAGES = {"en": "English", "zh": "Chinese"}
LATE_MS = (0, 20, 80)
VOICE = "ryan"


@dataclass(frozen=True, slots=True)
class Text:
    text: str
    language: str
    frames: int
    segments: tuple[TextSegment, ...]


@dataclass(slots=True)
class Utterance:
    request_id: str
    text: Text
    chunks: list[tuple[float, int, int]] = field(default_factory=list)  # (arrival s, sample offset, samples)
    words: list[WordTiming] = field(default_factory=list)
    final: bool = False  # the engine's final chunk arrived
    cancelled: bool = False


# -- texts ----------------------------------------------------------------------------------------
def load_texts(corpus: Path, max_frames: int, kind: str = "paragraph") -> list[Text]:
    """The corpus rows of `kind`, cut as the gateway cuts them; rows of one segment are skipped."""
    limits = GatewayConfig()
    out = []
    for line in corpus.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["kind"] != kind or row["language"] not in LANGUAGES:
            continue
        language = LANGUAGES[row["language"]]
        pipeline = UtteranceText(language, limits.segment_max_chars, limits.segment_clause_min_chars)
        segments = tuple(pipeline.feed(row["text"]) + pipeline.flush())
        if len(segments) >= 2:
            out.append(Text(row["text"], language, min(int(row["frames"]), max_frames), segments))
    if not out:
        raise SystemExit(f"no multi-segment {kind} texts in {corpus}")
    return out


# -- one utterance ----------------------------------------------------------------------------------
Live = dict[str, tuple[Qwen3Stream, Utterance]]  # open utterances by request id


async def speak(engine: Qwen3Engine, rid: str, text: Text, live: Live) -> Utterance:
    loop = asyncio.get_running_loop()
    utt = Utterance(rid, text)
    stream = engine.open(
        SynthesisRequest(request_id=rid, voice=VOICE, language=text.language, forced_frames=text.frames)
    )
    live[rid] = (stream, utt)
    try:
        for segment in text.segments:
            stream.push(segment)
        stream.close_text()
        async for chunk in stream:
            now = loop.time()
            utt.words += chunk.words
            if len(chunk.samples):
                utt.chunks.append((now, chunk.sample_offset, len(chunk.samples)))
            utt.final = utt.final or chunk.final
    finally:
        live.pop(rid, None)
    return utt


# -- measurement -----------------------------------------------------------------------------------
def expected_starts(text: Text) -> list[int]:
    """First sample of each segment when the forced frames are shared as the engine shares them."""
    shares = share_frames(text.frames, list(text.segments))
    return [SAMPLES_PER_FRAME * s for s in itertools.accumulate([0, *shares[:-1]])]


def segment_starts(utt: Utterance) -> tuple[list[int], int]:
    """First sample of each segment, and how many came from the engine's word timings (a finished
    segment's words span exactly its frames); the others (not finished: cancelled) from the shares."""
    starts, observed = expected_starts(utt.text), 0
    for k, seg in enumerate(utt.text.segments):
        end = seg.source_offset(len(seg.text))
        inside = [w.start_sample for w in utt.words if seg.char_start <= w.char_start < end]
        if inside:
            starts[k], observed = min(inside), observed + 1
    return starts, observed


@dataclass(slots=True)
class Tally:
    join_late: list[float] = field(default_factory=list)  # seconds
    other_late: list[float] = field(default_factory=list)
    join_rise: list[float] = field(default_factory=list)  # lateness minus the previous chunk's
    other_rise: list[float] = field(default_factory=list)
    utterances: int = 0
    completed: int = 0
    cancelled: int = 0
    overloaded: int = 0  # opens refused (retried)
    segments: int = 0
    starts_from_words: int = 0  # segments whose start the word timings gave
    starts_unlike_shares: int = 0  # completed utterances whose segment starts differ from the shares
    checked: int = 0  # completed utterances under the audio-length check
    inserted_samples: int = 0  # sum over them of (samples - forced frames x samples per frame)
    length_mismatches: int = 0
    timeline_gaps: int = 0  # chunks whose offset is not the previous chunk's end
    audio_s: float = 0.0

    def add(self, utt: Utterance) -> None:
        self.utterances += 1
        self.completed += utt.final
        self.cancelled += utt.cancelled
        self.segments += len(utt.text.segments)
        self.audio_s += sum(n for _, _, n in utt.chunks) / SAMPLE_RATE
        if not utt.chunks:
            return
        starts, observed = segment_starts(utt)
        self.starts_from_words += observed
        self.starts_unlike_shares += utt.final and starts != expected_starts(utt.text)
        t0 = utt.chunks[0][0]
        late = [t - t0 - off / SAMPLE_RATE for t, off, _ in utt.chunks]
        joins: set[int] = set()
        for b in starts[1:]:
            i = next((i for i, (_, off, n) in enumerate(utt.chunks) if off <= b < off + n), None)
            if i is None:
                continue  # not reached (cancelled)
            self.join_late.append(late[i])
            if i > 0:
                self.join_rise.append(late[i] - late[i - 1])
            joins.add(i)
        for i in range(1, len(late)):
            if i not in joins:
                self.other_late.append(late[i])
                self.other_rise.append(late[i] - late[i - 1])
        end = 0
        for _, off, n in utt.chunks:
            self.timeline_gaps += off != end
            end = off + n
        if utt.final:
            self.checked += 1
            inserted = end - utt.text.frames * SAMPLES_PER_FRAME
            self.inserted_samples += inserted
            self.length_mismatches += inserted != 0


def quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def lateness_summary(late: Sequence[float], rise: Sequence[float]) -> dict[str, float | int]:
    ms = [1000 * x for x in late]
    out: dict[str, float | int] = {
        "chunks": len(ms),
        "p50_ms": quantile(ms, 0.5),
        "p90_ms": quantile(ms, 0.9),
        "max_ms": max(ms, default=math.nan),
    }
    for limit in LATE_MS:
        out[f"late_over_{limit}ms"] = sum(x > limit for x in ms) / len(ms) if ms else math.nan
    rise_ms = [1000 * x for x in rise]
    out["rise_p50_ms"] = quantile(rise_ms, 0.5)
    out["rise_p90_ms"] = quantile(rise_ms, 0.9)
    return out


def level_report(n: int, tally: Tally, wall_s: float) -> dict[str, Any]:
    return {
        "concurrency": n,
        "wall_s": wall_s,
        "utterances": tally.utterances,
        "completed": tally.completed,
        "cancelled": tally.cancelled,
        "overloaded": tally.overloaded,
        "segments": tally.segments,
        "joins": len(tally.join_late),
        "segment_starts_from_words": tally.starts_from_words,
        "starts_unlike_shares": tally.starts_unlike_shares,
        "audio_s": tally.audio_s,
        "audio_s_per_s": tally.audio_s / wall_s if wall_s > 0 else math.nan,
        "at_joins": lateness_summary(tally.join_late, tally.join_rise),
        "other_chunks": lateness_summary(tally.other_late, tally.other_rise),
        "audio_length": {
            "utterances_checked": tally.checked,
            "inserted_samples": tally.inserted_samples,
            "mismatched_utterances": tally.length_mismatches,
            "timeline_gaps": tally.timeline_gaps,
            "samples_per_frame": SAMPLES_PER_FRAME,
        },
    }


# -- levels ------------------------------------------------------------------------------------------
async def run_level(
    engine: Qwen3Engine, n: int, texts: list[Text], args: argparse.Namespace, progress: Any
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_new, hard_stop = start + args.seconds, start + args.level_timeout
    tally, live = Tally(), Live()
    picks, ids = itertools.count(), itertools.count()
    task = progress.add_task(f"c={n}", total=args.seconds, status="")

    async def worker() -> None:
        while loop.time() < stop_new:
            text = texts[next(picks) % len(texts)]
            try:
                tally.add(await speak(engine, f"c{n}-{next(ids)}", text, live))
            except Overloaded as exc:  # a slot not yet given back by the previous utterance
                tally.overloaded += 1
                await asyncio.sleep(min(0.05, exc.retry_after_s))

    async def watch() -> None:
        while True:
            now = loop.time()
            phase = "running" if now < stop_new else f"draining {len(live)}"
            progress.update(
                task,
                completed=min(now - start, args.seconds),
                status=f"{phase}: {tally.completed} done, {len(tally.join_late)} joins",
            )
            if now >= hard_stop:
                for stream, utt in list(live.values()):
                    utt.cancelled = True
                    stream.cancel()
                return
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(worker() for _ in range(n)))
    finally:
        watcher.cancel()
    wall = loop.time() - start
    progress.update(
        task,
        completed=args.seconds,
        status=f"{wall:.0f} s: {tally.completed} done, "
        f"{tally.cancelled} cancelled, {len(tally.join_late)} joins",
    )
    return level_report(n, tally, wall)


async def warm_up(engine: Qwen3Engine, texts: list[Text], n: int) -> None:
    """One short utterance per row up to n at once: first-use costs out of the first level."""
    short = [Text(t.text, t.language, min(t.frames, 40), t.segments) for t in texts]
    await asyncio.gather(*(speak(engine, f"warm-{i}", short[i % len(short)], {}) for i in range(n)))


def build_engine(args: argparse.Namespace, top: int) -> Qwen3Engine:
    """The engine as cadence.engines serves it, for `top` concurrent utterances, on --model (a random
    checkpoint of --size is written there first when it holds none; in a temporary folder, removed
    once loaded, without --model)."""
    path = args.model or Path(tempfile.mkdtemp(prefix="qwen3-random-"))
    if not (path / "config.json").exists():
        from bench.random_checkpoint import write_checkpoint

        write_checkpoint(path, args.size, args.device, CORPUS)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    batch = min(512, top)
    try:
        return Qwen3Engine.from_pretrained(
            path,
            args.device,
            dtype,
            Qwen3EngineConfig(
                scheduler=SchedulerConfig(
                    codec_slots=top,
                    queue_limit=top,
                    max_batch=batch,
                    max_codec_rows=batch,
                    max_tokens_per_step=batch + 512,
                ),
                runner=RunnerConfig(max_len=args.max_len, enforce_eager=args.device == "cpu"),
                kv_slots=top,
                progress_bar=not args.quiet,
            ),
        )
    finally:
        if args.model is None:
            shutil.rmtree(path, ignore_errors=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    texts = load_texts(args.corpus, args.max_frames)
    top = max(levels)
    t0 = time.perf_counter()
    engine = build_engine(args, top)
    built_s = time.perf_counter() - t0
    await engine.start()
    started_s = time.perf_counter() - t0
    rows = []
    try:
        await warm_up(engine, texts, min(top, 16))
        with Progress(
            TextColumn("{task.description:>7}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            disable=args.quiet,
        ) as progress:
            for n in levels:
                rows.append(await run_level(engine, n, texts, args, progress))
    finally:
        await engine.stop()
    return {
        "figure": "segment joins: chunk lateness against real-time playback from the first chunk",
        "model_shapes": args.size if args.model is None else str(args.model.name),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "command": " ".join(
            [
                "python",
                "bench/gpu_segment_joins.py",
                *(Path(a).name if a.startswith("/") else a for a in args.argv),
            ]
        ),
        "texts": len(texts),
        "segments_per_text": sum(len(t.segments) for t in texts) / len(texts),
        "max_frames": args.max_frames,
        "seconds_per_level": args.seconds,
        "level_timeout_s": args.level_timeout,
        "engine": {
            "max_streams": engine.econfig.max_streams,
            "max_batch": engine.econfig.scheduler.max_batch,
            "max_len": engine.econfig.runner.max_len,
            "voice": VOICE,
        },
        "load_s": built_s,
        "ready_s": started_s,
        "levels": rows,
    }


def finite_or_none(value: Any) -> Any:
    """The report with NaN (nothing measured) as null, so that it is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'conc':>5} {'utts':>5} {'joins':>6} | {'join p50':>8} {'p90':>7} {'max':>7} {'>0':>5} {'>20':>5} "
        f"{'>80':>5} | {'other p50':>9} {'p90':>7} {'max':>7} {'>0':>5} {'>20':>5} {'>80':>5} | {'inserted':>8}"
    )
    for r in report["levels"]:
        j, o, a = r["at_joins"], r["other_chunks"], r["audio_length"]
        cells = [f"{r['concurrency']:>5} {r['completed']:>5} {r['joins']:>6} |"]
        for s, w in ((j, 8), (o, 9)):
            cells.append(
                f"{s['p50_ms']:>{w}.1f} {s['p90_ms']:>7.1f} {s['max_ms']:>7.1f} "
                + " ".join(f"{s[f'late_over_{x}ms']:>5.0%}" for x in LATE_MS)
                + " |"
            )
        cells.append(f"{a['inserted_samples']:>8}")
        print(" ".join(cells))
    print(
        "(lateness in ms against real-time playback from each utterance's first chunk; '>x': fraction of "
        "chunks later than x ms; inserted: samples beyond forced frames x samples per frame)"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint folder (a random one of --size is written there when it holds none)",
    )
    ap.add_argument("--size", default="1.7B", choices=["1.7B", "0.6B", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="1,64,256", help="comma-separated levels")
    ap.add_argument("--seconds", type=float, default=20.0, help="per level: new utterances start this long")
    ap.add_argument(
        "--level-timeout", type=float, default=60.0, help="per level: utterances still open are cancelled"
    )
    ap.add_argument("--max-frames", type=int, default=200, help="cap on an utterance's forced frames")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--corpus", type=Path, default=CORPUS)
    ap.add_argument("--out", type=Path, default=None, help="JSON report")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(finite_or_none(report), indent=1, allow_nan=False))
    print_table(report)
    return report


if __name__ == "__main__":
    main()
