"""The Cadence load test: a closed-loop concurrency sweep over `WS /v1/stream` (bench/README.md).

C streams, each its own WebSocket session, each sending one corpus prompt at a time (prompts drawn
in order, cycling, across all streams) and waiting for its last packet before the next. Streams are
spread over several processes, each running an asyncio loop; their records are merged per point.
Every request may carry `"bench": {"forced_frames": N}` in its `speak.append` (the row's `frames`),
which the gateway passes to the engine as SynthesisRequest.forced_frames.

Beyond the engine's capacity a request may wait in its queue (`utterance.queued`; TTFA and RTF then
count from its admission, its wait is reported apart) or be refused (`overloaded`): the client then
waits the `retry_after_ms` the server gave and sends the same prompt again, as a real client would.
Levels may be relative to the capacity the server reports (GET /v1/load): `capacity`, or a
multiple of it such as `1.5x` or `2x`, of the largest capacity it has reported in this run (an
overloaded point can make the engine's estimate dip for a while); run a point above the capacity
before them, so that the engine has measured what it holds.

    cadence bench --url ws://127.0.0.1:8000/v1/stream --corpus deploy/bench/corpus.jsonl \
        --concurrency 1,256,512,capacity,1.5x,2x --min-seconds 60 -o deploy/bench/run.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import websockets

from clients.client import (
    ClientError,
    Done,
    Error,
    Interrupted,
    Packet,
    PlaybackClock,
    Queued,
    Session,
    Words,
    connect,
)
from clients.loadtest_report import (
    PRICE_PER_HOUR_USD,
    UNFINISHED,
    RequestRecord,
    goodput_of_peak,
    headline,
    plot,
    summarize,
    word_lags_ms,
)
from clients.say import failure

DEFAULT_LEVELS = "1,8,32,64,128,256,384,512,768,1024"
DEFAULT_URL = "ws://127.0.0.1:8000/v1/stream"
DEFAULT_RETRY_AFTER_S = 1.0  # an overloaded answer that names no wait
STREAMS_PER_PROCESS = 128
DRAIN_S = 60.0  # past the longest window, what a request under way when it ends may take to finish
GPU_MEMORY_METRIC = "cadence_gpu_memory_peak_bytes"
ENGINE_FIGURE_METRIC = "cadence_engine_figure"
CPU_METRIC = "process_cpu_seconds_total"
GC_PAUSE_METRIC = "cadence_gc_pause_seconds"
GC_LONGEST_METRIC = "cadence_gc_pause_longest_seconds"
WORKER_CPU_FIGURE = "worker_cpu_seconds"


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    frames: int | None


@dataclass(frozen=True, slots=True)
class WorkerJob:
    url: str
    streams: tuple[int, ...]
    prompts: tuple[Prompt, ...]
    session_options: dict[str, Any]
    forced: bool
    buffer_ms: float
    warmup_s: float
    drain_s: float  # after the window, how long the requests under way may take to finish


@dataclass(slots=True)
class Shared:
    """Cross-process state of one point."""

    ready: Any  # mp.Value("i"): workers whose sessions are open
    go: EventType  # start the closed loop
    stop: EventType  # send no new request
    start_at: Any  # mp.Value("d"): perf_counter of go
    next_prompt: Any  # mp.Value("i"): the corpus cursor
    measured: Any  # mp.Value("i"): requests sent inside the window and finished
    results: Any  # mp.Queue: one list of RequestRecord per worker


def load_corpus(path: Path) -> list[Prompt]:
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(Prompt(str(row["text"]), int(row["frames"]) if row.get("frames") else None))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# -- one worker process ---------------------------------------------------------------------------
def _worker(job: WorkerJob, shared: Shared) -> None:
    records = asyncio.run(_run_streams(job, shared))
    shared.results.put(records)


async def _run_streams(job: WorkerJob, shared: Shared) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    async with contextlib.AsyncExitStack() as stack:
        connecting = asyncio.Semaphore(32)

        async def open_session() -> Session:
            async with connecting:
                return await stack.enter_async_context(connect(job.url, **job.session_options))

        sessions = await asyncio.gather(*(open_session() for _ in job.streams))
        with shared.ready.get_lock():
            shared.ready.value += 1
        await asyncio.to_thread(shared.go.wait)
        measure_from = shared.start_at.value + job.warmup_s
        in_flight: dict[int, float] = {}  # stream -> when its request's speak.end went
        chars: dict[int, int] = {}
        tasks = [
            asyncio.create_task(
                _stream_loop(session, stream, job, shared, measure_from, records, in_flight, chars)
            )
            for session, stream in zip(sessions, job.streams, strict=True)
        ]
        await asyncio.to_thread(shared.stop.wait)
        # the requests under way finish, but within the drain: one that never ends must not take
        # this process's records with it; it is recorded as unfinished
        _, pending = await asyncio.wait(tasks, timeout=job.drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream, sent_at in in_flight.items():
            records.append(RequestRecord(stream, chars[stream], 0.0, sent_at, None, None, 0, UNFINISHED))
    return records


async def _stream_loop(
    session: Session,
    stream: int,
    job: WorkerJob,
    shared: Shared,
    measure_from: float,
    out: list[RequestRecord],
    in_flight: dict[int, float],
    chars: dict[int, int],
) -> None:
    prompt: Prompt | None = None
    while not shared.stop.is_set():
        if prompt is None:
            with shared.next_prompt.get_lock():
                index = shared.next_prompt.value
                shared.next_prompt.value += 1
            prompt = job.prompts[index % len(job.prompts)]
        in_flight[stream], chars[stream] = time.perf_counter(), len(prompt.text)
        record = await one_request(session, stream, prompt, job)
        del in_flight[stream]
        out.append(record)
        if record.ok and record.ended_at >= measure_from:
            with shared.measured.get_lock():
                shared.measured.value += 1
        if record.error == "connection_closed":
            return
        if record.refused:  # as a real client: wait what the server asked, then the same prompt again
            await asyncio.sleep(
                DEFAULT_RETRY_AFTER_S if record.retry_after_s is None else record.retry_after_s
            )
            continue
        prompt = None
        if record.error is not None:
            await asyncio.sleep(0.1)  # back off a little before the next request


async def one_request(session: Session, stream: int, prompt: Prompt, job: WorkerJob) -> RequestRecord:
    uid = session.new_utterance_id()
    extra: dict[str, Any] = (
        {"bench": {"forced_frames": prompt.frames}} if job.forced and prompt.frames else {}
    )
    clock = PlaybackClock(session.sample_rate, job.buffer_ms)
    first: float | None = None
    last: float | None = None
    samples = 0
    error: str | None = None
    packets: list[tuple[int, float]] = []  # (sample past the packet, arrival): for the words' lag
    words: list[tuple[float, list[int]]] = []
    queued, queued_s = False, 0.0
    answered_at: float | None = None
    retry_after_s: float | None = None
    await session.append(uid, prompt.text, **extra)
    await session.end(uid)
    ended = time.perf_counter()
    async for event in session.events(uid):
        if isinstance(event, Packet):
            first = event.received_at if first is None else first
            last = event.received_at
            samples += event.samples
            clock.on_packet(event.samples, event.received_at)
            packets.append((event.sample_offset + event.samples, event.received_at))
        elif isinstance(event, Words):
            words.append((event.received_at, [w.start_ms for w in event.words]))
        elif isinstance(event, Queued):
            queued, answered_at = True, event.received_at
        elif isinstance(event, Error):
            error = event.code
            if error == "overloaded":
                answered_at = answered_at or time.perf_counter()
                retry_after_s = None if event.retry_after_ms is None else event.retry_after_ms / 1000
        elif isinstance(event, Interrupted):
            error = "interrupted"
        elif isinstance(event, Done):
            queued_s = event.queued_ms / 1000
            break
    return RequestRecord(
        stream,
        len(prompt.text),
        samples / session.sample_rate,
        ended,
        first,
        last,
        clock.underruns,
        error,
        clock.first_underrun_s,
        clock.stall_s,
        word_lags_ms(packets, words, session.sample_rate),
        queued,
        queued_s,
        answered_at,
        retry_after_s,
    )


# -- one point --------------------------------------------------------------------------------------
def run_point(
    args: argparse.Namespace, prompts: list[Prompt], concurrency: int, progress: Any
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    processes = args.processes or max(
        1, min(os.cpu_count() or 1, math.ceil(concurrency / STREAMS_PER_PROCESS))
    )
    processes = min(processes, concurrency)
    shared = Shared(
        ctx.Value("i", 0),
        ctx.Event(),
        ctx.Event(),
        ctx.Value("d", 0.0),
        ctx.Value("i", 0),
        ctx.Value("i", 0),
        ctx.Queue(),
    )
    jobs = [
        WorkerJob(
            args.url,
            tuple(range(p, concurrency, processes)),
            tuple(prompts),
            session_options(args),
            not args.no_forced,
            args.buffer_ms,
            args.warmup_seconds,
            args.max_seconds + DRAIN_S,
        )
        for p in range(processes)
    ]
    workers = [ctx.Process(target=_worker, args=(job, shared), daemon=True) for job in jobs]
    for worker in workers:
        worker.start()
    target = 3 * concurrency
    task = progress.add_task(f"C={concurrency}: connecting", total=target)
    deadline = time.perf_counter() + 120
    while shared.ready.value < processes:
        if time.perf_counter() > deadline or not all(w.is_alive() for w in workers):
            shared.stop.set()
            shared.go.set()
            raise RuntimeError(f"C={concurrency}: the load-test workers could not open their sessions")
        time.sleep(0.05)
    shared.start_at.value = time.perf_counter()
    shared.go.set()
    window_start = shared.start_at.value + args.warmup_seconds
    url = args.metrics_url or metrics_url(args.url)
    cpu_at_start: dict[str, float] | None = None
    gc_at_start: dict[str, float] = {}
    while True:
        now = time.perf_counter()
        phase = "warming up" if now < window_start else "measuring"
        if cpu_at_start is None and now >= window_start:
            at_start = scrape(url)
            cpu_at_start, gc_at_start = cpu_seconds(at_start), gc_counts(at_start)
        progress.update(task, completed=shared.measured.value, description=f"C={concurrency}: {phase}")
        long_enough = now >= window_start + args.min_seconds and shared.measured.value >= target
        if long_enough or now >= window_start + args.max_seconds or not any(w.is_alive() for w in workers):
            break
        time.sleep(0.2)
    window_end = time.perf_counter()
    text = scrape(url)  # under load, before draining
    figures = parse_engine_figures(text)
    cpu = cpu_shares(
        cpu_at_start or {}, cpu_seconds(text), window_end - max(window_start, shared.start_at.value)
    )
    shared.stop.set()
    progress.update(task, description=f"C={concurrency}: draining")
    records: list[RequestRecord] = []
    received = 0
    give_up = time.perf_counter() + args.max_seconds + DRAIN_S + 60
    while received < len(workers) and time.perf_counter() < give_up:
        try:
            records.extend(shared.results.get(timeout=1.0))
            received += 1
        except queue.Empty:
            if not any(w.is_alive() for w in workers) and shared.results.empty():
                break  # a worker died without reporting: use what the others sent
    for worker in workers:
        worker.join(timeout=10)
    if received < len(workers):
        print(
            f"C={concurrency}: {len(workers) - received} of {len(workers)} load-test workers sent no records"
        )
    progress.update(task, completed=shared.measured.value, description=f"C={concurrency}: done")
    gpu = gpu_memory_gb(url)
    point = summarize(concurrency, records, (window_start, window_end), args.price_per_hour, gpu)
    point["workers_unreported"] = len(workers) - received
    point.update(engine_capacity(load_url(args.url)))
    point.update(cpu)
    point.update(gc_figures(gc_at_start, gc_counts(text)))
    if figures:
        point["engine_figures"] = figures
    return point


def session_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"pacing": args.pacing, "timestamps": "word"}
    for name in ("voice", "language", "token", "alignment"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    return options


# -- run metadata -------------------------------------------------------------------------------------
def metrics_url(stream_url: str) -> str:
    base = stream_url.replace("wss://", "https://").replace("ws://", "http://")
    return base.split("/v1/")[0] + "/metrics"


def load_url(stream_url: str) -> str:
    return metrics_url(stream_url).rsplit("/", 1)[0] + "/v1/load"


def engine_capacity(url: str) -> dict[str, int]:
    """The capacity the engine's measured cost admits now and its upper bound (GET /v1/load);
    empty when the server does not say."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            engine = json.loads(response.read().decode()).get("engine", {})
    except (OSError, ValueError):
        return {}
    admission = engine.get("admission") or {}
    out = {"capacity": int(engine["capacity"])} if "capacity" in engine else {}
    if "max_streams" in admission:
        out["max_streams"] = int(admission["max_streams"])
    return out


def raise_open_files_limit() -> None:
    """Each stream holds a socket: the soft limit on open files up to the hard one, so that a
    process of the sweep does not fail on the common default of 1 024."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (max(soft, 1 << 16) if hard == resource.RLIM_INFINITY else hard, hard)
            )


def resolve_level(level: str, capacity: int | None) -> int:
    """A level of --concurrency: a number, `capacity`, or a multiple of it (`1.5x`)."""
    text = level.strip().lower()
    if text in ("capacity", "cap") or text.endswith("x"):
        if not capacity:
            raise SystemExit(f"--concurrency {level}: the server reports no capacity (GET /v1/load)")
        factor = 1.0 if text in ("capacity", "cap") else float(text[:-1])
        return max(1, round(factor * capacity))
    return int(text)


def scrape(url: str) -> str:
    """The gateway's /metrics text ('' when it cannot be read)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def gpu_memory_gb(url: str) -> float | None:
    """Peak GPU memory from the gateway's /metrics, when the engine reports it."""
    for line in scrape(url).splitlines():
        if line.startswith(GPU_MEMORY_METRIC):
            return round(float(line.split()[-1]) / 1e9, 2)
    return None


def cpu_seconds(text: str) -> dict[str, float]:
    """CPU seconds used so far by the gateway's process and by its engine workers, from /metrics."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(CPU_METRIC + " "):
            out["gateway"] = float(line.split()[-1])
    worker = parse_engine_figures(text).get(WORKER_CPU_FIGURE)
    if worker is not None:
        out["engine_workers"] = worker
    return out


def gc_counts(text: str) -> dict[str, float]:
    """The gateway's collector pauses so far, from /metrics: `count_G` and `seconds_G` per generation
    G, and `longest_s` (the longest in the last minute), when the gateway times them (`cadence serve`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == GC_LONGEST_METRIC:
            out["longest_s"] = float(value)
        elif name.startswith((GC_PAUSE_METRIC + "_sum{", GC_PAUSE_METRIC + "_count{")):
            generation = name.partition('generation="')[2].partition('"')[0]
            kind = "seconds" if name.startswith(GC_PAUSE_METRIC + "_sum{") else "count"
            out[f"{kind}_{generation}"] = float(value)
    return out


def gc_figures(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """The collector over a point's window (two `gc_counts`): pauses and seconds paused, in all and
    per generation, and the longest pause in the minute before the window's end."""
    if "longest_s" not in end:
        return {}
    out = {
        "gateway_gc_pause_longest_ms": round(1000 * end["longest_s"], 1),
        "gateway_gc_pauses": 0.0,
        "gateway_gc_pause_total_s": 0.0,
    }
    for key in sorted(end):
        kind, _, generation = key.partition("_")
        if kind not in ("count", "seconds"):
            continue
        delta = end[key] - start.get(key, 0.0)
        if kind == "count":
            out[f"gateway_gc_pauses_gen{generation}"] = delta
            out["gateway_gc_pauses"] += delta
        else:
            out[f"gateway_gc_pause_s_gen{generation}"] = round(delta, 3)
            out["gateway_gc_pause_total_s"] = round(out["gateway_gc_pause_total_s"] + delta, 3)
    return out


def cpu_shares(start: dict[str, float], end: dict[str, float], wall_s: float) -> dict[str, float]:
    """Each process's CPU over the window as % of one core (the gateway's event loop has one)."""
    return {
        f"{name}_cpu_pct": round(100 * (end[name] - start[name]) / wall_s, 1)
        for name in end
        if name in start and wall_s > 0
    }


def parse_engine_figures(text: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(ENGINE_FIGURE_METRIC + '{name="'):
            name = line[len(ENGINE_FIGURE_METRIC) + 7 :].split('"', 1)[0]
            figures[name] = round(float(line.split()[-1]), 3)
    return figures


def _command_output(*command: str) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


async def server_engine(args: argparse.Namespace) -> dict[str, Any]:
    async with connect(args.url, **session_options(args)) as session:
        return dict(session.engine)


def command_line(argv: list[str] | None) -> str:
    """The command that produced a run, as a person would type it again (absolute paths, which name
    the machine that ran it, by their file names)."""
    args = [Path(a).name if a.startswith("/") else a for a in (sys.argv[1:] if argv is None else argv)]
    if Path(sys.argv[0]).name.startswith("cadence"):
        return shlex.join(["cadence", "bench", *args])
    return shlex.join(["python", "-m", "clients.loadtest", *args])


def run_metadata(args: argparse.Namespace, engine: dict[str, Any], command: str) -> dict[str, Any]:
    gpu = args.gpu or _command_output("nvidia-smi", "--query-gpu=name", "--format=csv,noheader")
    return {
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on this machine at the start
        "gpu": gpu.splitlines()[0] if gpu else None,
        "model_shapes": args.model_shapes,
        "alignment": getattr(args, "alignment", None),  # the sessions' (None: the server's default)
        "engine": engine,
        # a copied tree's .git may lag the files it holds: CADENCE_COMMIT names the real commit
        "commit": os.environ.get("CADENCE_COMMIT") or _command_output("git", "rev-parse", "HEAD"),
        "versions": {"python": platform.python_version(), "websockets": metadata.version("websockets")},
        "command": command,
    }


# -- the command -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cadence bench", description="Closed-loop concurrency sweep over /v1/stream."
    )
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument(
        "--corpus", type=Path, default=Path("deploy/bench/corpus.jsonl"), help="JSON lines: text, frames"
    )
    p.add_argument(
        "--concurrency",
        default=DEFAULT_LEVELS,
        help=f"comma-separated C values ({DEFAULT_LEVELS}); `capacity` and multiples such as `2x` "
        "take the largest capacity the server has reported in the run",
    )
    p.add_argument("--min-seconds", type=float, default=60.0, help="measure at least this long per point")
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop a point after this long regardless")
    p.add_argument("--warmup-seconds", type=float, default=10.0, help="closed loop before measuring")
    p.add_argument("--stop-rtf", type=float, default=1.5, help="end the sweep once p90 RTF exceeds this")
    p.add_argument(
        "--processes", type=int, default=0, help=f"client processes (0: one per {STREAMS_PER_PROCESS})"
    )
    p.add_argument("--buffer-ms", type=float, default=150.0, help="player buffer for the underrun figure")
    p.add_argument("--no-forced", action="store_true", help="do not send bench.forced_frames")
    p.add_argument("--pacing", choices=("asap", "realtime"), default="asap")
    p.add_argument(
        "--alignment", choices=("async", "sync"), help="sessions' `alignment` (a server with --aligner)"
    )
    p.add_argument("--voice")
    p.add_argument("--language")
    p.add_argument("--token")
    p.add_argument("--price-per-hour", type=float, default=PRICE_PER_HOUR_USD)
    p.add_argument("--gpu", help="GPU name for the record (default: nvidia-smi here)")
    p.add_argument("--model-shapes", default=None, help='e.g. "1.7B" or "0.6B"')
    p.add_argument("--metrics-url", help="gateway /metrics (default: from --url)")
    p.add_argument("-o", "--output", type=Path, default=None, help="JSON path (PNGs beside it)")
    p.add_argument("--no-plots", action="store_true")
    return p


def bench_main(argv: list[str] | None = None, command: str | None = None) -> int:
    """The `cadence bench` command; `command` is what to record as the command line, when a wrapper
    (e.g. one that starts a local gateway first) ran it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        prompts = load_corpus(args.corpus)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else exc
        print(f"error: --corpus {args.corpus}: {reason}", file=sys.stderr)
        return 2
    levels = [c for c in args.concurrency.split(",") if c.strip()]
    for level in levels:  # a typo fails before the sweep, not after an hour of it
        resolve_level(level, 1)
    try:
        engine = asyncio.run(server_engine(args))
    except (ClientError, OSError, websockets.WebSocketException) as exc:
        print(failure(exc, args.url), file=sys.stderr)
        return 2
    output: Path = (
        args.output
        or Path("deploy/bench")
        / f"loadtest-{engine.get('name', 'engine')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    run = run_metadata(args, engine, command or command_line(argv))
    run.update({"points": [], "reference": None, "headline": None, "scaling_ratio": None})
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    raise_open_files_limit()
    peak_capacity = 0
    with Progress(*columns, console=console) as progress:
        for level in levels:
            peak_capacity = max(peak_capacity, engine_capacity(load_url(args.url)).get("capacity", 0))
            concurrency = resolve_level(level, peak_capacity or None)
            point = run_point(args, prompts, concurrency, progress)
            if not level.strip().isdigit():
                point["level"] = level.strip()  # e.g. "2x": twice the capacity the server reported
            run["points"].append(point)
            goodput_of_peak(run["points"])
            run["headline"] = headline(run["points"])
            output.write_text(json.dumps(run, indent=1, ensure_ascii=False) + "\n")
            progress.console.print(
                f"C={concurrency}: {point['requests']} req, TTFA p50/p90 {point['ttfa_p50_ms']}/"
                f"{point['ttfa_p90_ms']} ms, RTF p50/p90 {point['rtf_p50']}/{point['rtf_p90']}, "
                f"underrun {point['underrun_streams_pct']} % ({point['underrun_in_first_s_pct']} % in "
                f"the first s, first at p50 {point['underrun_first_s_p50']} s), stall p90/p99 "
                f"{point['stall_ms_p90']}/{point['stall_ms_p99']} ms, {point['chars_per_s']} chars/s, "
                f"${point['usd_per_m_chars']}/M chars, errors {point['errors']}"
            )
            progress.console.print(
                f"  admission: capacity {point.get('capacity')}, admitted {point['admitted']}, queued "
                f"{point['queued']} (wait p50/p90 {point['queue_wait_p50_ms']}/{point['queue_wait_p90_ms']} "
                f"ms), refused {point['refused']}, excess answered p90 {point['excess_answer_ms_p90']} ms, "
                f"goodput {point['audio_s_per_s']} audio-s/s"
            )
            stages = {
                k: v
                for k, v in point.get("engine_figures", {}).items()
                if k.startswith(("step_ms", "batch_"))
            }
            if stages:
                progress.console.print(f"  engine per step: {stages}")
            cpu = {k: v for k, v in point.items() if k.endswith("_cpu_pct")}
            if cpu:
                progress.console.print(f"  CPU, % of one core: {cpu}")
            if point["words_timed"]:
                progress.console.print(
                    f"  words after their first audio p50/p90 {point['words_lag_ms_p50']}/"
                    f"{point['words_lag_ms_p90']} ms; {point['words_before_audio_pct']} % came before it"
                )
            if point["rtf_p90"] is not None and point["rtf_p90"] > args.stop_rtf:
                break
    if not args.no_plots and run["points"]:
        title = f"{engine.get('name', '')} {engine.get('model', '')} — {run['gpu'] or 'no GPU'}"
        for path in plot(run["points"], output.with_suffix(""), title):
            console.print(f"wrote {path}")
    console.print(f"wrote {output}; headline {run['headline']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
