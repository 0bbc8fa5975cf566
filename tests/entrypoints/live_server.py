"""A real `vllm-lite serve` subprocess on a free local port, for end-to-end tests.

The server runs in its own session (process group), so `stop()` can always reap it and the
engine-core processes it spawned, even when a graceful shutdown fails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Live descendant pids of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return found


def started_children(server_pid: int, pids: set[int]) -> set[int]:
    """Those of `pids` (descendants of the server) that the server started through
    multiprocessing: spawned, or forked by its fork server (whose command line they share, and
    which is the server's own child); not multiprocessing's helpers (resource tracker, fork server)."""
    started = set()
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if b"spawn_main" in command or (b"multiprocessing.forkserver" in command and parent != server_pid):
            started.add(pid)
    return started


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class LiveServer:
    def __init__(self, model: Path, log_path: Path, served_model_name: str, api_key: str,
                 extra_args: tuple[str, ...] = (), scheme: str = "http",
                 client_options: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None) -> None:
        """`client_options`: httpx.Client's arguments for reaching it (TLS trust, a Unix socket's
        transport); `extra_env`: variables of the server's environment beside this process's."""
        self.port = free_port()
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.client_options = client_options or {}
        self.api_key = api_key
        self.log_path = log_path
        command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(model),
                   "--port", str(self.port), "--served-model-name", served_model_name,
                   "--api-key", api_key, "--uvicorn-log-level", "warning", *extra_args]
        if "--dtype" not in extra_args:  # outputs are compared with fp32 references (auto is bf16 on some CPUs)
            command += ["--dtype", "float32"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               **(extra_env or {})}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO_ROOT, start_new_session=True)
        self.children: set[int] = set()

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with httpx.Client(timeout=2.0, **self.client_options) as client:
                    healthy = client.get(f"{self.base_url}/health").status_code == 200
                if healthy:
                    self.children = descendants(self.proc.pid)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful: the engine core is shut down too), then SIGKILL of the whole group
        if it does not exit in time. Returns the server's exit code."""
        if self.proc.poll() is None:
            self.children |= descendants(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill_group(self) -> None:
        """Last resort after `stop`: SIGKILL whatever is left in the server's process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def leftover_processes(self, timeout_s: float = 10.0) -> set[int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            left = {pid for pid in self.children if alive(pid)}
            if not left:
                return left
            time.sleep(0.1)
        return {pid for pid in self.children if alive(pid)}


@contextlib.contextmanager
def running_server(model: Path, log_path: Path, served_model_name: str, api_key: str,
                   extra_args: tuple[str, ...] = (), **reach: Any) -> Iterator[LiveServer]:
    """A healthy server for the `with` block; stopped and its process group reaped after.
    `reach`: LiveServer's scheme, client_options and extra_env."""
    live = LiveServer(model, log_path, served_model_name, api_key, extra_args, **reach)
    try:
        live.wait_healthy()
        yield live
    finally:
        live.stop()
        live.kill_group()


# A reply no CPU finishes before a client's disconnect or cancel reaches the server (a few hundred
# tokens of the tiny models take well under a second on a fast one)
LONG_GENERATION = 32_000


@contextlib.contextmanager
def running_long_server(model: Path, log_path: Path, served_model_name: str, api_key: str,
                        extra_args: tuple[str, ...] = ()) -> Iterator[LiveServer]:
    """`running_server` with room for a `LONG_GENERATION` reply: past the tiny models' 512
    positions, as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN allows (set for the server alone)."""
    with running_server(model, log_path, served_model_name, api_key,
                        ("--max-model-len", str(LONG_GENERATION + 64), *extra_args),
                        extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}) as live:
        yield live
