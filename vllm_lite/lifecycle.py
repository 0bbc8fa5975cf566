"""Child-process lifecycle, in one place for every process the engine starts: the engine core a
client spawns (engine/launch.py, engine/core_client.py) and the ranks an executor spawns
(executor/multiproc.py, executor/worker_proc.py).

    spawn -> ready handshake -> death watch -> stop-and-reap -> release resources

`ProcessResources` holds what an owner must release and never refers to the owner, so a
`weakref.finalize` on the owner can release it when nobody called shutdown.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from vllm_lite.cpu_info import openmp_child_env

TERMINATE_TIMEOUT_S = 5.0  # SIGTERM's grace before SIGKILL


def spawn(target: Callable[..., Any], args: tuple[Any, ...], name: str, daemon: bool = False,
          imports_torch: bool = False) -> BaseProcess:
    """Start `target(*args)` in a fresh interpreter (spawn: no forked threads or CUDA state),
    with the OpenMP defaults that keep its threads from spin-waiting (cpu_info.py).

    `imports_torch` (an engine core, a rank): forked instead by this process's fork server, a
    single-threaded interpreter that imported torch once (multiprocessing's "forkserver"), so
    each such child starts in ~0.1 s instead of spending 2-3 s importing torch. The child takes
    this process's environment as it is now; it is forked only while the variables read when
    torch and its libraries load (LOAD_TIME_ENV) are those the server started with, else
    spawned. VLLM_WORKER_MULTIPROC_METHOD=spawn (vLLM's variable) spawns them always."""
    with openmp_child_env():
        forked = (imports_torch and torch_child_start_method() == "forkserver"
                  and torch_fork_server_env() == _load_time_env())
        if forked:
            proc = multiprocessing.get_context("forkserver").Process(
                target=_with_environment, args=(dict(os.environ), target, args), name=name, daemon=daemon)
        else:
            proc = multiprocessing.get_context("spawn").Process(target=target, args=args, name=name, daemon=daemon)
        proc.start()
    return proc


START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
START_METHODS = ("forkserver", "spawn")

# Variables read once, as the fork server's interpreter, torch, libgomp, oneDNN / MKL and our
# kernels load (prefixes); any other is read where it is used, after a forked child took its
# parent's environment.
LOAD_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_", "PYTHON", "LD_",
                 "VLLM_LITE_CPU_CAPABILITY", "ATEN_", "CUDA_", "HIP_", "ROCR_", "NCCL_")


def torch_child_start_method() -> str:
    """How engine-core and rank processes start: VLLM_WORKER_MULTIPROC_METHOD, else forkserver."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in START_METHODS:
        raise ValueError(f"{START_METHOD_ENV}={method!r} is not one of {', '.join(START_METHODS)} (vLLM's 'fork' "
                         "is not implemented: a fork copies the threads of the process that starts the engine)")
    return method


@functools.cache
def torch_fork_server_env() -> dict[str, str] | None:
    """Starts the fork server of `spawn(imports_torch=True)` (once per process, from the
    environment a child gets) and returns its load-time variables; None where there is no such
    server (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(TORCH_CHILD_MODULES))
    multiprocessing.forkserver.ensure_running()
    return _load_time_env()


def _load_time_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(LOAD_TIME_ENV)}


def _with_environment(environment: dict[str, str], target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """A forked child's entry: its parent's environment of the moment, then `target(*args)`."""
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


# What the fork server imports before it forks: torch and the modules its children run.
TORCH_CHILD_MODULES = ("torch", "vllm_lite.engine.core", "vllm_lite.executor.worker_proc")


def freeze_startup_heap() -> None:
    """Called once a long-running process has started (engine core, API server): what is alive
    then (modules, model, tokenizer, the app) leaves the garbage collector's generations, so its
    collections while serving scan only what serving creates; as vLLM's freeze_gc_heap. Without
    it, the API server spent about a quarter of its CPU under load in collections (perf)."""
    gc.collect()
    gc.freeze()


def ready_pipe() -> tuple[Connection, Connection]:
    """(reader, writer) for a child's ready report; pass the writer to the child, then close it."""
    return multiprocessing.get_context("spawn").Pipe(duplex=False)


def wait_ready_report(reader: Connection, proc: BaseProcess, timeout_s: float) -> bytes | None:
    """The child's ready report, or None when it exited without one (its exit code is then
    set). Raises TimeoutError when neither happens within `timeout_s`. Closes `reader`."""
    try:
        if not multiprocessing.connection.wait([reader, proc.sentinel], timeout_s):
            raise TimeoutError(f"{proc.name} did not report ready within {timeout_s:.0f} s")
        try:
            return reader.recv_bytes()
        except EOFError:
            proc.join(TERMINATE_TIMEOUT_S)
            return None
    finally:
        reader.close()


def stop_processes(procs: Sequence[BaseProcess], grace_s: float = 0.0,
                   terminate_timeout_s: float = TERMINATE_TIMEOUT_S) -> None:
    """Give the processes `grace_s` to exit on their own, then SIGTERM, then SIGKILL; every one
    is reaped (joined), so no zombie is left, also when it had died already."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + terminate_timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
        proc.join()


class DeathWatch:
    """A daemon thread that waits on the processes' sentinels and calls `on_death(dead)` once
    (with the processes that exited, already reaped) unless `stop()` came first."""

    def __init__(self, procs: Sequence[BaseProcess], on_death: Callable[[list[BaseProcess]], None],
                 name: str) -> None:
        self._procs = list(procs)
        self._on_death = on_death
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stand down (idempotent): later deaths are expected, not reported."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        os.write(self._stop_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(TERMINATE_TIMEOUT_S)
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _watch(self) -> None:
        by_sentinel = {proc.sentinel: proc for proc in self._procs}
        ready = multiprocessing.connection.wait([*by_sentinel, self._stop_r])
        if self._stopped.is_set():
            return
        dead = [by_sentinel[s] for s in ready if s in by_sentinel]
        for proc in dead:
            proc.join(1.0)  # its pipes close a moment before its exit code exists
        self._on_death(dead)


def on_parent_death(callback: Callable[[], None], name: str) -> None:
    """In a spawned child: call `callback` on a daemon thread once the process that spawned it
    is gone (even by SIGKILL). Nothing happens in a process nobody spawned."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        callback()

    threading.Thread(target=wait, name=name, daemon=True).start()


class SignalPipe:
    """Signals as a file descriptor: their C handler writes each signal's number to a wakeup
    pipe (`signal.set_wakeup_fd`), so a thread, or `multiprocessing.connection.wait` beside
    process sentinels, can wait for them. (A Python handler runs only on the main thread, and
    only once a blocking call there returns.) Main thread only, as `signal.signal` is."""

    def __init__(self, signums: Sequence[int]) -> None:
        self.signums = frozenset(signums)
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._previous = {signum: signal.signal(signum, _wake_only) for signum in self.signums}

    def received(self) -> bool:
        """Whether one of the signals came since the last call (consumes what the pipe holds)."""
        try:
            return any(signum in self.signums for signum in os.read(self.fd, 64))
        except BlockingIOError:
            return False

    def wait(self) -> None:
        """Block until one of the signals comes."""
        while True:
            multiprocessing.connection.wait([self.fd])
            if self.received():
                return

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self.fd)
        os.close(self._write_fd)


def _wake_only(signum: int, frame: Any) -> None:
    """Installed so that the C handler runs and writes the wakeup pipe; SignalPipe's reader acts."""


def describe_exit(procs: Sequence[BaseProcess]) -> str:
    return "; ".join(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}" for proc in procs)


@dataclass(slots=True, eq=False)
class ProcessResources:
    """What an owner of child processes must release. `release` is idempotent: it stops the
    death watch first (a stop we cause is not a death), then stops and reaps the processes,
    closes the sockets and the ZMQ context, and removes private directories."""

    ctx: zmq.Context | None = None
    procs: list[BaseProcess] = field(default_factory=list)
    sockets: list[zmq.Socket] = field(default_factory=list)
    private_dirs: list[str] = field(default_factory=list)
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    watch: DeathWatch | None = None
    released: bool = False

    def release(self, grace_s: float = 0.0) -> None:
        if self.released:
            return
        self.released = True
        if self.watch is not None:
            self.watch.stop()
        stop_processes(self.procs, grace_s)
        for sock in self.sockets:
            sock.close(linger=0)
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
        for cleanup in self.cleanups:
            cleanup()
        for directory in self.private_dirs:
            shutil.rmtree(directory, ignore_errors=True)
