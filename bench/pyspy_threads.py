"""Summarise a py-spy raw record (`py-spy record --format raw`) of the server, thread by thread.

Each engine worker thread is named by the first frame that identifies it (the step loop, the
worker's event loop, its reader and writer threads, the aligner); the gateway process is one entry. For each
thread: its samples (py-spy leaves out idle ones: a thread waiting for the GIL or a lock counts
nowhere) and the frames holding the most of them, inclusive.

    python3 bench/pyspy_threads.py pyspy-1.7b.txt --top 25 > summary.txt
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

THREAD_FRAMES = (
    "EngineCore._loop",
    "EngineCore._prepare_loop",
    "_WorkerLoop._write_engine_batches",
    "_WorkerLoop._read",
    "BaseEventLoop.run_forever",
    "AlignerWorker._serve",
)


def thread_of(frames: list[str]) -> str:
    if len(frames) < 2 or "spawn_main" not in frames[1]:
        return "gateway process"
    for frame in frames:
        name = frame.split(" (")[0]
        if name in THREAD_FRAMES:
            return "worker: " + name
    return "worker: other"


def summarise(path: Path, top: int) -> str:
    threads: collections.Counter[str] = collections.Counter()
    frames_by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread, n = thread_of(frames), int(count)
        threads[thread] += n
        for frame in set(frames[2:]):
            frames_by_thread[thread][frame] += n
    total = sum(threads.values())
    lines = [f"{path.name}: {total} samples"]
    for thread, n in threads.most_common():
        lines.append(f"\n== {thread}: {n} samples ({100 * n / total:.1f} %)")
        lines += [f"{c:7d}  {frame[:140]}" for frame, c in frames_by_thread[thread].most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("--top", type=int, default=25, help="frames listed per thread")
    args = ap.parse_args()
    print(summarise(args.record, args.top))


if __name__ == "__main__":
    main()
