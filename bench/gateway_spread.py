"""How SO_REUSEPORT spreads new connections over the gateway processes of `--gateways K`: opens
CONNECTIONS connections, one request each (GET /readyz, which names the process that answered),
and prints the count per process and the largest share over the even one, as JSON.

    cadence serve --engine null --gpus 2 --gateways 2 --redis redis://127.0.0.1:6379/0 --port 8870 &
    .venv/bin/python -m bench.gateway_spread --url http://127.0.0.1:8870 --connections 2000

The kernel picks a listener by a hash of each connection's addresses and ports, not by how busy
it is: the shares even out over many connections, while a handful of long sessions may all land
on one process.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import httpx


def spread(url: str, connections: int, key: str | None) -> Counter[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    seen: Counter[str] = Counter()
    for _ in range(connections):
        with httpx.Client(headers=headers) as http:  # a connection (and a source port) of its own
            seen[str(http.get(f"{url}/readyz", timeout=5).json()["replica"])] += 1
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8870")
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--key", default=None, help="an API key, when the gateway has keys")
    args = ap.parse_args()
    seen = spread(args.url, args.connections, args.key)
    even = args.connections / max(1, len(seen))
    print(
        json.dumps(
            {
                "connections": args.connections,
                "per_process": dict(sorted(seen.items())),
                "largest_over_even": round(max(seen.values()) / even, 3) if seen else None,
            }
        )
    )


if __name__ == "__main__":
    main()
