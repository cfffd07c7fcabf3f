"""The load test against a gateway started here: the real gateway with the eSpeak or the null
engine in a child process, then `cadence bench` (clients.loadtest) against it with the other flags.

    .venv/bin/python -m bench.loadtest_local --engine espeak --concurrency 1,8,32 --min-seconds 20 \
        -o deploy/bench/loadtest-espeak-2core.json
"""

from __future__ import annotations

import argparse
import shlex
import sys

from bench.common import gateway_process
from clients.loadtest import bench_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("espeak", "null"), default="espeak")
    parser.add_argument(
        "--max-streams",
        type=int,
        default=None,
        help="the engine's upper bound on admitted streams (default: the engine's own, auto)",
    )
    args, rest = parser.parse_known_args(argv)
    command = shlex.join(["python", "-m", "bench.loadtest_local", *(sys.argv[1:] if argv is None else argv)])
    options = {} if args.max_streams is None else {"max_streams": args.max_streams}
    with gateway_process(args.engine, **options) as url:
        return bench_main(["--url", url, *rest], command=command)


if __name__ == "__main__":
    raise SystemExit(main())
