"""eSpeak time to first audio over loopback, measured at the client: median and p90 of N requests.

Starts the real gateway with the eSpeak engine in a child process, opens one session and sends N
requests one after another (English and Mandarin agent-style replies, cycling); TTFA is the time
from sending `speak.end` to receiving the first audio packet.

    .venv/bin/python -m bench.ttfa_espeak -n 50 -o deploy/bench/ttfa-espeak.json
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import gateway_process, run_record, write_json
from clients.client import Done, Error, Packet, connect

PROMPTS = (
    "Sure, I can help with that. Your order shipped this morning.",
    "收到，谢谢！请稍等。您的订单已经发货了。",
    "Your estimated wait time is about three minutes.",
    "Got it, thanks! One moment, please.",
    "好的，我马上为您查询。",
)


async def measure(url: str, requests: int, warmup: int) -> tuple[list[float], list[str]]:
    ttfa: list[float] = []
    errors: list[str] = []
    async with connect(url, language="Auto") as session:
        for i in range(warmup + requests):
            uid = f"r{i}"
            await session.append(uid, PROMPTS[i % len(PROMPTS)])
            await session.end(uid)
            sent = time.perf_counter()
            first: float | None = None
            async for event in session.events(uid):
                if isinstance(event, Packet) and first is None:
                    first = event.received_at
                elif isinstance(event, Error):
                    errors.append(event.code)
                elif isinstance(event, Done):
                    break
            if i >= warmup and first is not None:
                ttfa.append((first - sent) * 1000.0)
    return ttfa, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3, help="requests before measuring")
    parser.add_argument("-o", "--output", type=Path, default=Path("deploy/bench/ttfa-espeak.json"))
    args = parser.parse_args(argv)
    with gateway_process("espeak") as url:
        ttfa, errors = asyncio.run(measure(url, args.requests, args.warmup))
    values = np.array(ttfa)
    record: dict[str, Any] = run_record(argv)
    record.update(
        {
            "engine": "espeak",
            "transport": "WS /v1/stream over loopback, one session, requests one after another",
            "requests": len(ttfa),
            "errors": errors,
            "ttfa_p50_ms": round(float(np.percentile(values, 50)), 2) if len(values) else None,
            "ttfa_p90_ms": round(float(np.percentile(values, 90)), 2) if len(values) else None,
            "ttfa_min_ms": round(float(values.min()), 2) if len(values) else None,
            "ttfa_max_ms": round(float(values.max()), 2) if len(values) else None,
        }
    )
    write_json(args.output, record)
    print(f"TTFA median {record['ttfa_p50_ms']} ms, p90 {record['ttfa_p90_ms']} ms over {len(ttfa)} requests")
    return 0 if ttfa and not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
