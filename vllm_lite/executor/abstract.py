from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

from vllm_lite.config import VllmConfig
from typing import Any

from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.rpc import RpcCall
from vllm_lite.wire import ModelRunnerOutput


class Executor(ABC):
    """Drives the workers of one engine core.

    Two ways to run a step: `execute_model` (blocking), or `submit_model` now and
    `take_model_output` later (async scheduling: the engine core schedules the next step
    meanwhile). Submitted steps run in submission order (a step may be launched on the device
    before the previous one's output reached the host, never before its work was queued), and
    their outputs are taken in that order; the two ways are not mixed while a step is submitted
    and not taken."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config

    @abstractmethod
    def determine_available_memory(self) -> int:
        """The bytes the KV cache may take on every rank under gpu_memory_utilization (each rank
        measures its own: `Worker.determine_available_memory`)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        """Every rank's KV cache of `num_blocks` blocks, and linear-attention states for
        `num_state_slots` requests (a hybrid model's: VllmConfig.num_state_slots)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        """Start running a step; returns without waiting for it."""

    @abstractmethod
    def take_model_output(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not taken yet (waits for it)."""

    @abstractmethod
    def profile(self, is_start: bool, profile_prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        """start_profile / stop_profile on every rank (`Worker.profile`), with no step in flight."""

    @abstractmethod
    def collective_rpc(self, call: RpcCall) -> list[Any]:
        """vLLM's collective_rpc: `call` on every rank's worker, with no step in flight; the
        results in rank order. A call failing on a rank raises; the engine goes on."""

    def step_thread_mode(self) -> contextlib.AbstractContextManager:
        """Held by a thread that runs this executor's steps for as long as it runs them (the
        engine-core process's loop): the thread state the steps need is set once, not entered
        and left every step. Nothing to hold by default."""
        return contextlib.nullcontext()

    def shutdown(self) -> None:
        pass
