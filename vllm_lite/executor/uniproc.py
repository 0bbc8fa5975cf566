from __future__ import annotations

import functools
import gc
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_lite.config import VllmConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup, join_launcher_group
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.executor.abstract import Executor
from vllm_lite.executor.step_order import HeldSteps, StepPipeline, StepResult, launches_ahead
from vllm_lite.rpc import RpcCall, run_call
from vllm_lite.wire import ModelRunnerOutput
from vllm_lite.worker.worker import Worker, worker_class


class UniProcExecutor(Executor):
    """The single worker lives in the engine-core process (tensor_parallel_size == 1).
    `execute_model` runs a step in the calling thread; submitted steps run on one step thread
    (started on first use), so the engine core schedules while the model runs (torch releases
    the GIL in its kernels)."""

    def __init__(self, vllm_config: VllmConfig, tp: TensorParallelGroup = SINGLE_RANK, local_rank: int = 0) -> None:
        """`tp`: this process's rank of the model (vLLM's external_launcher: `LauncherExecutor`)."""
        super().__init__(vllm_config)
        self.worker = worker_class(vllm_config)(vllm_config, tp, local_rank)
        self.driver_worker = WorkerWrapper(self.worker)
        self.launch_ahead = self.launches_ahead(self.worker.device)
        self._step_thread: StepThread | None = None

    def step_thread_mode(self) -> torch.inference_mode:
        return self.worker.step_thread_mode()

    @staticmethod
    def launches_ahead(device: torch.device) -> bool:
        """Whether the step thread launches a submitted step before finishing the one before it
        (`step_order.launches_ahead`)."""
        return launches_ahead(device.type)

    def determine_available_memory(self) -> int:
        return self.worker.determine_available_memory()

    def initialize_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self.worker.initialize_kv_cache(num_blocks, num_state_slots)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self._step_thread is None or not self._step_thread.num_pending, "a submitted step is not taken"
        return self.worker.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        self._started_step_thread().submit(scheduler_output)

    def take_model_output(self) -> ModelRunnerOutput:
        assert self._step_thread is not None, "no step was submitted"
        return self._step_thread.take()

    def profile(self, is_start: bool, profile_prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        """On the thread that runs the steps (the torch profiler records the thread it starts in,
        and must be stepped and stopped there): the step thread when steps are submitted (async
        scheduling; started now if no step was yet), else the caller's."""
        call = functools.partial(self.worker.profile, is_start, profile_prefix, delay_iterations, max_iterations)
        if self._step_thread is None and not self.vllm_config.scheduler_config.async_scheduling:
            call()
        else:
            self._started_step_thread().call(call)

    def collective_rpc(self, call: RpcCall) -> list[Any]:
        """On the thread that runs the steps, as `profile` (the worker's state is that thread's)."""
        run = functools.partial(run_call, self.worker, call)
        if self._step_thread is None and not self.vllm_config.scheduler_config.async_scheduling:
            return [run()]
        return [self._started_step_thread().call(run)]

    def _started_step_thread(self) -> StepThread:
        if self._step_thread is None:
            self._step_thread = StepThread(self.worker, self.launch_ahead)
        return self._step_thread

    def shutdown(self) -> None:
        if self._step_thread is not None:  # (it stops a profiling session still on, where it runs)
            self._step_thread.stop()
            self._step_thread = None
        else:
            self.worker.stop_profiling()


@dataclass(slots=True)
class WorkerWrapper:
    """vLLM's WorkerWrapperBase, as far as trainers written against vLLM reach into it
    (`llm.llm_engine.model_executor.driver_worker.worker.model_runner.model`)."""

    worker: Worker


class LauncherExecutor(UniProcExecutor):
    """vLLM's external_launcher: every process of a torchrun job (or of a trainer's own process
    group) runs the whole engine in process, for its rank of the model; the ranks of one engine
    schedule alike because they are given the same requests (vLLM's contract) and agree on the KV
    cache's size here."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        device = vllm_config.device_config.device
        tp, self.joined_world = join_launcher_group(vllm_config.parallel_config.tensor_parallel_size, device)
        try:
            super().__init__(vllm_config, tp, int(os.environ.get("LOCAL_RANK", "0")))
        except BaseException:
            if self.joined_world:  # (a failed start leaves the world it joined)
                dist.destroy_process_group()
            raise
        self.tp = tp

    def determine_available_memory(self) -> int:
        """The least any rank of this engine measured: every rank's scheduler must have as many blocks."""
        available = torch.tensor([self.worker.determine_available_memory()], dtype=torch.int64,
                                 device=self.worker.device)
        if self.tp.size > 1:
            dist.all_reduce(available, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(available.item())

    def shutdown(self) -> None:
        """The worker (whose model's layers hold the process group) is let go before the group is
        left: a gloo group still referenced when the interpreter exits can abort it (torch's
        "terminate called without an active exception")."""
        super().shutdown()
        self.worker = self.tp = self.driver_worker = None  # type: ignore[assignment]
        gc.collect()
        if self.joined_world and dist.is_initialized():
            dist.destroy_process_group()
            self.joined_world = False


class StepThread:
    """Runs submitted steps on the worker one after another (`StepPipeline`: launching ahead or
    finishing first), in order, and hands out their outputs in that order; a step's exception is
    raised by the `take` of that step (the engine core then fails as a synchronous step would)."""

    _STOP = None
    _FLUSH = "flush"

    def __init__(self, worker: Worker, launch_ahead: bool = False) -> None:
        self.worker = worker
        self.held_steps = HeldSteps(launch_ahead)
        self._pipeline = StepPipeline(worker, launch_ahead)
        self._inputs: queue.SimpleQueue[SchedulerOutput | Callable[[], None] | str | None] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[StepResult | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm_lite-step")
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self.held_steps.num_pending

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.held_steps.submitted()
        self._inputs.put(scheduler_output)

    def take(self) -> ModelRunnerOutput:
        if self.held_steps.take_needs_flush():
            self._inputs.put(self._FLUSH)
        output = self._outputs.get()
        self.held_steps.taken()
        if isinstance(output, BaseException):
            raise output
        return output

    def stop(self) -> None:
        """Lets a running step finish (it may be writing the KV cache), then ends the thread."""
        self._inputs.put(self._STOP)
        self._thread.join()

    def call(self, function: Callable[[], Any]) -> Any:
        """Runs `function` on the step thread, between steps (none may be submitted and not
        taken): returns what it returned, raises what it raised."""
        assert not self.num_pending, "a submitted step is not taken"
        self._inputs.put(function)
        result = self._outputs.get()
        if isinstance(result, BaseException):
            raise result
        return result.value

    def _run(self) -> None:
        if self.worker.device.type == "cuda":
            torch.cuda.set_device(self.worker.device)  # the current device is per thread
        with self.worker.step_thread_mode():  # (thread-local, as the current device)
            while True:
                item = self._inputs.get()
                if item is self._STOP:
                    self._pipeline.stop()
                    self.worker.stop_profiling()
                    return
                if callable(item):  # (`call`: its result stands in the outputs)
                    self._outputs.put(_called(item))
                    continue
                results = self._pipeline.flush() if item is self._FLUSH else self._pipeline.run(item)
                for result in results:
                    self._outputs.put(result)


class _Returned:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _called(function: Callable[[], Any]) -> BaseException | _Returned:
    try:
        return _Returned(function())
    except BaseException as exc:  # raised by `call`, in the caller's thread
        return exc
