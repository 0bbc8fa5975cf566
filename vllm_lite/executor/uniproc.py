from __future__ import annotations

import queue
import threading

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.executor.abstract import Executor
from vllm_lite.wire import ModelRunnerOutput
from vllm_lite.worker.worker import Worker


class UniProcExecutor(Executor):
    """The single worker lives in the engine-core process (tensor_parallel_size == 1).
    `execute_model` runs a step in the calling thread; submitted steps run on one step thread
    (started on first use), so the engine core schedules while the model runs (torch releases
    the GIL in its kernels)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.worker = Worker(vllm_config)
        self._step_thread: StepThread | None = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self._step_thread is None or not self._step_thread.num_pending, "a submitted step is not taken"
        return self.worker.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._step_thread is None:
            self._step_thread = StepThread(self.worker)
        self._step_thread.submit(scheduler_output)

    def take_model_output(self) -> ModelRunnerOutput:
        assert self._step_thread is not None, "no step was submitted"
        return self._step_thread.take()

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.stop()
            self._step_thread = None


class StepThread:
    """Runs submitted steps on the worker one after another, in order; a step's exception is
    raised by the `take` of that step (the engine core then fails as a synchronous step would)."""

    _STOP = None

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_pending = 0  # submitted, not taken (only the engine core's thread changes it)
        self._inputs: queue.SimpleQueue[SchedulerOutput | None] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[ModelRunnerOutput | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm_lite-step")
        self._thread.start()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.num_pending += 1
        self._inputs.put(scheduler_output)

    def take(self) -> ModelRunnerOutput:
        assert self.num_pending > 0, "no submitted step to take"
        output = self._outputs.get()
        self.num_pending -= 1
        if isinstance(output, BaseException):
            raise output
        return output

    def stop(self) -> None:
        """Lets a running step finish (it may be writing the KV cache), then ends the thread."""
        self._inputs.put(self._STOP)
        self._thread.join()

    def _run(self) -> None:
        if self.worker.device.type == "cuda":
            torch.cuda.set_device(self.worker.device)  # the current device is per thread
        while True:
            scheduler_output = self._inputs.get()
            if scheduler_output is self._STOP:
                return
            try:
                output: ModelRunnerOutput | BaseException = self.worker.execute_model(scheduler_output)
            except BaseException as exc:  # handed to the engine core's thread, which raises it
                output = exc
            self._outputs.put(output)
