"""A client's start_profile / stop_profile, as vLLM's LLMEngine and AsyncLLM take them: refused
while profiling is not configured, one session at a time, the session's overrides checked here
before any process is asked (profiler_config.py)."""

from __future__ import annotations

import os
import socket

from vllm_lite.exceptions import ProfilerAlreadyActiveError
from vllm_lite.profiler_config import NOT_ENABLED, ProfilerConfig, check_profile_session


class ProfileSessions:
    def __init__(self, config: ProfilerConfig) -> None:
        self.config = config
        self.active = False

    def begin(self, profile_prefix: str | None, delay_iterations: int | None, max_iterations: int | None) -> None:
        """Raises unless a session may start now (the caller then starts it and calls `failed`
        if that raised)."""
        self.check_enabled()
        if self.active:
            raise ProfilerAlreadyActiveError()
        check_profile_session(profile_prefix, delay_iterations, max_iterations)
        self.active = True

    def failed(self) -> None:
        self.active = False

    def end(self) -> None:
        self.check_enabled()
        self.active = False

    def check_enabled(self) -> None:
        if not self.config.enabled:
            raise RuntimeError(NOT_ENABLED)


def frontend_trace_name(profile_prefix: str | None) -> str:
    """vLLM's name of a client process's trace: `[<prefix>_]<host>_<pid>.async_llm`."""
    name = f"{socket.gethostname()}_{os.getpid()}.async_llm"
    return f"{profile_prefix}_{name}" if profile_prefix else name
