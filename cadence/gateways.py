"""`cadence serve --gateways K`: K gateway processes behind one port, each with its own engine.

Each gateway process binds the same address with SO_REUSEPORT and runs the whole gateway (its own
event loop, on a core of its own) in front of its own engine: with `--gpus N`, a WorkerPoolEngine
over a disjoint share of the GPUs (gateway i of K owns GPUs [i*N/K, (i+1)*N/K)), so each GPU's
admission is decided by the one pool that feeds it. Linux spreads new connections over the
listening sockets by a hash of the connection's addresses, not by load: a connection stays on the
process it reached, and the shares even out only over many connections.

The gateway processes are replicas of one cluster (gateway.cluster, hence `--redis`): what one
process cannot answer alone (an interrupt of an utterance another one holds, voices, per-key
quotas) goes through Redis as between replicas on different hosts. Each registers as
`{replica_id}/g{i}`.

The parent holds the port (bound, not listening, so it takes no connections) and supervises: a
gateway that dies after it became ready is started again; one that dies before it ever became
ready stops them all (a start-up fault is not cured by retrying). SIGTERM or SIGINT to the parent
is passed on once to every gateway, each of which drains its sessions as a single gateway does.
The parent exits 0 only when every gateway ended as a stop ends; one it did not ask to stop, or
one that died otherwise while it drained, makes the exit status 1.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from types import FrameType

from cadence.engines import EngineOptions, build_engine, gpu_count
from gateway.config import GatewayConfig

log = logging.getLogger("cadence.gateways")

RESTART_DELAY_S = 1.0  # before a gateway that died is started again
MAX_RESTARTS = 5  # within RESTART_WINDOW_S: past that the parent gives up and stops them all
RESTART_WINDOW_S = 60.0
# how a gateway asked to stop ends: drained (0), stopped before it served (gateway_main's 3), or
# stopped by the signal itself, before its server took SIGTERM over
STOPPED = (0, 3, -signal.SIGTERM)


def gateway_count(text: str, gpus: str | None) -> int:
    """`--gateways K` or `auto`: one per GPU when `--gpus` names more than one, else one."""
    if text == "auto":
        return gpu_count(gpus) if gpus not in (None, "0") else 1
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise SystemExit("--gateways must be a positive number or auto")
    return count


def gpu_shares(gpus: int, gateways: int, visible: str | None) -> list[list[str]]:
    """The CUDA device ids each gateway owns: disjoint, in order, as even as the counts allow."""
    if gateways > gpus:
        raise SystemExit(f"--gateways {gateways} needs at least as many GPUs (--gpus {gpus})")
    ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
    return [ids[i * gpus // gateways : (i + 1) * gpus // gateways] for i in range(gateways)]


@dataclass(frozen=True, slots=True)
class GatewayPlan:
    """What every gateway process is started with (picklable: it crosses a spawn)."""

    options: EngineOptions
    config: GatewayConfig
    host: str
    port: int
    log_level: str
    insecure: bool


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) that other SO_REUSEPORT sockets of this user may share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def ending(exitcode: int | None) -> str:
    """A process's end in words: the signal that killed it, or its exit status."""
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def _stop_with_parent() -> None:
    """SIGTERM to this process (a graceful drain) as soon as the parent is gone, however it went."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def gateway_main(plan: GatewayPlan, index: int, share: list[str] | None, ready: Event) -> None:
    """One gateway process: its engine over its share of the GPUs, served on the shared port."""
    from gateway.server import build_server

    os.setpgrp()  # a terminal's Ctrl-C reaches the parent alone, which passes it on once
    # SIGINT is blocked from the parent's fork until here: a Ctrl-C sent to the parent's group
    # before this process left it waits, and is the parent's to pass on, so it is dropped
    if signal.SIGINT in signal.sigpending():
        signal.sigwait({signal.SIGINT})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _stop_with_parent()
    options = plan.options
    if share is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(share)  # the pool maps its workers onto these
        options = replace(options, gpus=str(len(share)))
    config = replace(plan.config, replica_id=f"{plan.config.replica_id}/g{index}")
    sock = reuseport_socket(plan.host, plan.port)
    server = build_server(
        build_engine(options),
        plan.host,
        plan.port,
        config,
        insecure=plan.insecure,
        freeze_gc=True,
        log_level=plan.log_level,
    )
    server.on_started = ready.set
    server.run(sockets=[sock])
    if not ready.is_set():
        sys.exit(3)


class Supervisor:
    """Starts the K gateway processes, restarts one that dies, and stops them all on a signal."""

    def __init__(self, plan: GatewayPlan, shares: list[list[str] | None]) -> None:
        self.plan = plan
        self.shares = shares
        self.context = mp.get_context("spawn")
        self.processes: list[BaseProcess | None] = [None] * len(shares)
        self.ready: list[Event | None] = [None] * len(shares)
        self.stopping = False
        self.asked_to_stop: set[int] = set()  # the pids this parent sent SIGTERM
        self.restarts: list[float] = []

    def _start(self, index: int) -> None:
        ready = self.context.Event()
        process = self.context.Process(
            target=gateway_main,
            args=(self.plan, index, self.shares[index], ready),
            name=f"cadence-gateway-{index}",
        )
        # the child is in this process group until gateway_main moves it: SIGINT stays blocked in it
        # until then (a mask crosses fork and exec), so a Ctrl-C meant for this parent cannot end it
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        self.processes[index], self.ready[index] = process, ready
        if self.stopping:  # a signal while it started found no process
            self._stop(process)

    def _stop(self, process: BaseProcess) -> None:
        if process.pid is not None and process.exitcode is None:
            os.kill(process.pid, signal.SIGTERM)
            self.asked_to_stop.add(process.pid)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.stopping:
            self.stopping = True
            for process in self.processes:
                if process is not None:
                    self._stop(process)

    def run(self) -> int:
        """Until a signal (0 once every gateway drained, else 1) or a gateway fault that restarting
        does not cure (1)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for index in range(len(self.shares)):
            if not self.stopping:  # a signal while they start stops the ones started, starts no more
                self._start(index)
        print(f"cadence: {len(self.shares)} gateway processes on port {self.plan.port}", flush=True)
        code = 0
        while not self.stopping:
            sentinels = {p.sentinel: i for i, p in enumerate(self.processes) if p is not None}
            for sentinel in wait(list(sentinels), timeout=0.5):
                if self.stopping:
                    break
                assert isinstance(sentinel, int)
                code = self._gone(sentinels[sentinel])
                if code:
                    self._on_signal(signal.SIGTERM, None)
                    break
        self._join()
        return max(code, self._unstopped())

    def _gone(self, index: int) -> int:
        process, ready = self.processes[index], self.ready[index]
        assert process is not None and ready is not None
        process.join()
        self.processes[index] = None  # its death is told here, not again at the end
        if not ready.is_set():
            log.error("gateway %d exited (%s) before it was ready: stopping", index, process.exitcode)
            print(
                f"cadence: gateway {index} (pid {process.pid}) failed to start: {ending(process.exitcode)}",
                file=sys.stderr,
            )
            return 1
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(self.restarts) > MAX_RESTARTS:
            print(f"cadence: gateways died {len(self.restarts)} times in a minute: stopping", file=sys.stderr)
            return 1
        print(
            f"cadence: gateway {index} (pid {process.pid}) ended unexpectedly: {ending(process.exitcode)}; "
            "starting it again",
            file=sys.stderr,
        )
        time.sleep(RESTART_DELAY_S)
        if self.stopping:  # its sessions ended undrained, and nothing replaced it
            print(f"cadence: gateway {index} was not started again: stopping", file=sys.stderr)
            return 1
        self._start(index)
        return 0

    def _join(self) -> None:
        """Every gateway drains within the drain timeout (plus uvicorn's margin), or is killed."""
        grace_s = self.plan.config.drain_timeout_s + 10
        deadline = time.monotonic() + grace_s
        for index, process in enumerate(self.processes):
            if process is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                print(
                    f"cadence: gateway {index} (pid {process.pid}) did not drain within {grace_s:.0f} s: killing it",
                    file=sys.stderr,
                )
                process.kill()
                process.join()

    def _unstopped(self) -> int:
        """1 if a gateway ended otherwise than a stop ends (each said on standard error), else 0."""
        code = 0
        for index, process in enumerate(self.processes):
            if process is None:
                continue
            asked = process.pid in self.asked_to_stop
            if asked and process.exitcode in STOPPED:
                continue
            when = "while it drained" if asked else "not asked to stop"
            print(
                f"cadence: gateway {index} (pid {process.pid}) ended unexpectedly ({when}): "
                f"{ending(process.exitcode)}",
                file=sys.stderr,
            )
            code = 1
        return code


def serve_gateways(plan: GatewayPlan, gateways: int) -> int:
    """Holds the port, then runs `gateways` gateway processes on it until stopped."""
    if not plan.config.redis_url:
        raise SystemExit(
            f"--gateways {gateways} needs --redis: the gateway processes share interrupts, voices "
            "and quotas through it, as replicas do"
        )
    gpus = plan.options.gpus
    if gpus in (None, "0"):
        if plan.options.name == "qwen3":
            raise SystemExit("--gateways with --engine qwen3 needs --gpus N (each gateway owns its GPUs)")
        shares: list[list[str] | None] = [None] * gateways  # each its own in-process CPU engine
    else:
        assert gpus is not None
        shares = list(gpu_shares(gpu_count(gpus), gateways, os.environ.get("CUDA_VISIBLE_DEVICES")))
    try:
        anchor = reuseport_socket(plan.host, plan.port)  # a port in use fails here, before any start
    except OSError as e:
        raise SystemExit(f"cadence: cannot bind {plan.host}:{plan.port}: {e}") from None
    try:
        port = int(anchor.getsockname()[1])
        return Supervisor(replace(plan, port=port), shares).run()
    finally:
        anchor.close()
