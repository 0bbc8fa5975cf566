"""One process's torch profiler session, as vLLM's TorchProfilerWrapper runs it: `start` begins
recording (or, with delay_iterations, that many steps later), `step` is called once per engine
step (the schedule's steps, the delay, max_iterations), `stop` writes the Chrome trace
(TensorBoard's handler: `<name>.<time>.pt.trace.json[.gz]`) and the table of operators by their
own CPU time (`<name>.profiler_out.txt`) into the configured folder."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from vllm_lite.profiler_config import ProfilerConfig

logger = logging.getLogger(__name__)
_ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "CUDA": torch.profiler.ProfilerActivity.CUDA}
TABLE_ROWS = 50
STEP_EVENT = "vllm_lite::step"  # (vLLM names its steps in the trace too)


class TorchProfiler:
    def __init__(self, config: ProfilerConfig, device: str, name: str, log_table: bool = False) -> None:
        """`name`: the trace files' name (per session, `set_name`); `log_table`: log the operator
        table at stop (vLLM prints it on rank 0)."""
        self.config = config
        self.activities = config.activities(device)
        self.name = name
        self.log_table = log_table
        self.profiler: torch.profiler.profile | None = None
        self._active = False  # between start and stop (recording, or waiting out the delay)
        self._delay = config.delay_iterations
        self._max = config.max_iterations
        self._steps_since_start = 0
        self._recorded_steps = 0
        self._schedule = _schedule(config)
        self._unrecorded_steps = 0  # a schedule's wait and warmup steps still to come

    def annotate_step(self) -> Any:
        """A `STEP_EVENT` range around one engine step in the trace while recording."""
        return torch.profiler.record_function(STEP_EVENT) if self.profiler is not None else contextlib.nullcontext()

    def set_name(self, name: str) -> None:
        if not self._active:
            self.name = name

    def start(self, delay_iterations: int | None = None, max_iterations: int | None = None) -> None:
        """A second start while a session is on changes nothing (as vLLM)."""
        if self._active:
            return
        self._delay = self.config.delay_iterations if delay_iterations is None else delay_iterations
        self._max = self.config.max_iterations if max_iterations is None else max_iterations
        self._active, self._steps_since_start, self._recorded_steps = True, 0, 0
        if self._delay == 0:
            self._record()

    def step(self) -> None:
        """After each engine step."""
        if not self._active:
            return
        self._steps_since_start += 1
        if self.profiler is None and self._delay > 0 and self._steps_since_start == self._delay:
            self._record()
            return
        if self.profiler is None:
            return
        if self._schedule is not None:
            self.profiler.step()
        if self._unrecorded_steps > 0:
            self._unrecorded_steps -= 1
            return
        self._recorded_steps += 1
        if self._max > 0 and self._recorded_steps >= self._max:
            self.stop()

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        profiler, self.profiler = self.profiler, None
        if profiler is None:  # (stopped during the delay: nothing recorded)
            return
        profiler.stop()  # (writes the trace)
        try:
            table = profiler.key_averages(group_by_input_shape=self.config.torch_profiler_record_shapes).table(
                sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)
        except UnicodeDecodeError as exc:
            # torch 2.13 can garble an event name it recorded with Python stacks in a tensor-parallel
            # rank: the trace is written, the table of its events cannot be read back
            logger.warning("profiler: %s: the operator table is not written (torch could not read its own "
                           "events: %s); the trace is", self.name, exc)
            return
        with open(os.path.join(self.config.torch_profiler_dir, f"{self.name}.profiler_out.txt"), "w") as f:
            f.write(table + "\n")
        if self.log_table:
            logger.info("profiler: %s\n%s", self.name, table)

    def _record(self) -> None:
        os.makedirs(self.config.torch_profiler_dir, exist_ok=True)
        config = self.config
        self.profiler = torch.profiler.profile(
            activities=[_ACTIVITIES[a] for a in self.activities], schedule=self._schedule,
            record_shapes=config.torch_profiler_record_shapes, profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack, with_flops=config.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                config.torch_profiler_dir, worker_name=self.name, use_gzip=config.torch_profiler_use_gzip))
        self.profiler.start()
        # (starting takes the schedule's first step)
        self._unrecorded_steps = max(config.wait_iterations + config.warmup_iterations - 1, 0)
        logger.info("profiler: recording %s into %s", self.name, config.torch_profiler_dir)


def _schedule(config: ProfilerConfig) -> Any:
    """torch's wait / warmup / active schedule, or None (every step recorded)."""
    if config.warmup_iterations == 0 and config.wait_iterations == 0:
        return None
    return torch.profiler.schedule(wait=config.wait_iterations, warmup=config.warmup_iterations,
                                   active=config.active_iterations, repeat=1)
