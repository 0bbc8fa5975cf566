"""`vllm-lite serve --api-server-count N`: N API-server processes on one port, clients of one
engine core, as vLLM's multi-API-server mode.

    supervisor (this process) --spawns--> engine core        (ipc://, private path)
                              --spawns--> API server 0..N-1  (AsyncLLM attached to the engine core)

Each API server binds the port with SO_REUSEPORT, so the kernel spreads new connections over
them; the supervisor first binds it alone, so a port that anything else holds (another
vllm-lite pool included) is an error at start, not a silent share, and then holds it (bound,
never listening) until it exits. The engine core tells its
clients apart by socket identity, so each server gets its own requests' outputs.

/metrics answers for the whole pool: the servers' counters and histograms live in
prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, a private directory the
supervisor makes and removes) and the engine's gauges come from the engine core itself. As in
vLLM, per-step numbers (`vllm:iteration_tokens_total`, inter-token latency) are observed by each
server for its own requests in the step, and `/load` and stored `/v1/responses` belong to the
server that answered.

SIGTERM or SIGINT: the servers drain (--shutdown-timeout), then the engine core stops; every
process is reaped. The death of any process stops the rest and exits with status 1, so a
supervisor above restarts the whole pool.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from types import FrameType

import uvloop

from vllm_lite.config import VllmConfig
from vllm_lite.engine.async_llm import AsyncLLM
from vllm_lite.engine.launch import EngineLaunch, launch_engine_core
from vllm_lite.entrypoints.cli_args import engine_args_from
from vllm_lite.entrypoints.openai.api_server import DrainingServer, serve
from vllm_lite.lifecycle import SignalPipe, describe_exit, on_parent_death, spawn, stop_processes

logger = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_EXIT_GRACE_S = 10.0  # beyond --shutdown-timeout: uvicorn closing connections, the engine client


def run_api_server_pool(args: argparse.Namespace) -> int:
    vllm_config = engine_args_from(args).create_engine_config()
    if vllm_config.parallel_config.data_parallel_size > 1:
        raise ValueError("--api-server-count > 1 with --data-parallel-size > 1 is not implemented: the API servers "
                         "share one engine core (one API server balances data-parallel engines)")
    reservation = reserve_port(args.host, args.port)
    port = reservation.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="vllm-lite-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the spawned servers
    launch: EngineLaunch | None = None
    servers: list[BaseProcess] = []
    signals: SignalPipe | None = None
    startup_sigterm = signal.signal(signal.SIGTERM, _interrupt)  # loading the model can take minutes
    try:
        launch = launch_engine_core(vllm_config)
        launch.wait_ready()
        signals = SignalPipe(_STOP_SIGNALS)
        for index in range(args.api_server_count):
            servers.append(spawn(api_server_main, (args, vllm_config, launch.address.address, port),
                                 name=f"vllm-lite-api-server-{index}"))
        logger.info("%d API servers on %s:%d, engine core pid %d", len(servers), args.host, port, launch.proc.pid)
        return supervise(launch.proc, servers, signals, args.shutdown_timeout + _EXIT_GRACE_S)
    except KeyboardInterrupt:
        logger.warning("stopped while starting")
        return 0
    finally:
        stop_processes(servers)
        if launch is not None:
            launch.abort()
        if signals is not None:
            signals.close()
        signal.signal(signal.SIGTERM, startup_sigterm)
        reservation.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def supervise(engine: BaseProcess, servers: Sequence[BaseProcess], signals: SignalPipe, drain_s: float) -> int:
    """Wait for a stop signal or a death. A signal: SIGTERM to each server (each drains), up to
    `drain_s` for them to exit (a second signal cuts it short), exit status 0 when all exited
    cleanly. A death: exit status 1 (the caller stops the rest)."""
    by_sentinel = {proc.sentinel: proc for proc in (engine, *servers)}
    ready = multiprocessing.connection.wait([signals.fd, *by_sentinel])
    if signals.fd not in ready:
        dead = [by_sentinel[sentinel] for sentinel in ready]
        for proc in dead:
            proc.join(1.0)
        logger.error("stopping the API server pool: %s", describe_exit(dead))
        return 1
    signals.received()
    for proc in servers:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + drain_s
    pending = {proc.sentinel: proc for proc in servers}
    while pending and time.monotonic() < deadline:
        ready = multiprocessing.connection.wait([signals.fd, *pending], deadline - time.monotonic())
        if signals.fd in ready and signals.received():
            logger.warning("a second stop signal: ending the API servers without waiting for their drain")
            break
        for sentinel in ready:
            pending.pop(sentinel, None)
    stop_processes(servers)
    # uvicorn re-raises the signal once it has shut down gracefully: -SIGTERM is a clean exit.
    failed = [proc for proc in servers if proc.exitcode not in (0, -signal.SIGTERM)]
    if failed:
        logger.error("API server pool: %s", describe_exit(failed))
    return 1 if failed or not engine.is_alive() else 0


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold host:port for the pool: a first bind without SO_REUSEPORT fails if anything holds the
    port; the socket returned (SO_REUSEPORT, bound, never listening, so it gets no connection)
    keeps it held until the pool exits. For port 0 it holds the port the kernel picked."""
    with _socket_for(host) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"--host {host} --port {port}: cannot listen there: {exc.strerror}") from None
        port = probe.getsockname()[1]
    return shared_socket(host, port)


def shared_socket(host: str, port: int) -> socket.socket:
    """A socket bound to the pool's port with SO_REUSEPORT: the kernel spreads new connections
    over the pool's listening ones."""
    sock = _socket_for(host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _socket_for(host: str) -> socket.socket:
    """A TCP socket of the family uvicorn would pick for `host` (IPv6 when it has a colon)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def api_server_main(args: argparse.Namespace, vllm_config: VllmConfig, engine_address: str, port: int) -> None:
    """One API server of the pool: an AsyncLLM attached to the pool's engine core. It drains and
    exits on SIGTERM, and on its own when the supervisor dies (even by SIGKILL)."""
    # Ctrl-C reaches the whole process group; the supervisor turns it into one SIGTERM each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    on_parent_death(lambda: os.kill(os.getpid(), signal.SIGTERM), name="api-server-parent-watch")
    listener = shared_socket(args.host, port)
    code = uvloop.run(serve(args, lambda: AsyncLLM(vllm_config, engine_address=engine_address),
                             sockets=[listener], server_class=PoolServer))
    sys.exit(code)


class PoolServer(DrainingServer):
    """Every signal is a drain (uvicorn takes a second SIGINT as "exit now"; in a pool the
    supervisor decides that, by SIGKILL after its grace)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(signal.SIGTERM, frame)
