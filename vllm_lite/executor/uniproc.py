from __future__ import annotations

import queue
import threading

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.executor.abstract import Executor
from vllm_lite.wire import ModelRunnerOutput
from vllm_lite.worker.model_runner import LaunchedStep
from vllm_lite.worker.worker import Worker


class UniProcExecutor(Executor):
    """The single worker lives in the engine-core process (tensor_parallel_size == 1).
    `execute_model` runs a step in the calling thread; submitted steps run on one step thread
    (started on first use), so the engine core schedules while the model runs (torch releases
    the GIL in its kernels)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.worker = Worker(vllm_config)
        self.launch_ahead = self.launches_ahead(self.worker.device)
        self._step_thread: StepThread | None = None

    @staticmethod
    def launches_ahead(device: torch.device) -> bool:
        """Whether the step thread launches a submitted step before finishing the one before it
        (`StepThread`): on a GPU, where a launch returns as soon as the work is queued. On a CPU
        a launch runs the whole forward pass, so the previous step's output would wait for it."""
        return device.type == "cuda"

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self._step_thread is None or not self._step_thread.num_pending, "a submitted step is not taken"
        return self.worker.execute_model(scheduler_output)

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._step_thread is None:
            self._step_thread = StepThread(self.worker, self.launch_ahead)
        self._step_thread.submit(scheduler_output)

    def take_model_output(self) -> ModelRunnerOutput:
        assert self._step_thread is not None, "no step was submitted"
        return self._step_thread.take()

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.stop()
            self._step_thread = None


_Held = LaunchedStep | BaseException  # a launched step, or the exception its launch raised


class StepThread:
    """Runs submitted steps on the worker one after another, in order, and hands out their
    outputs in that order; a step's exception is raised by the `take` of that step (the engine
    core then fails as a synchronous step would).

    With `launch_ahead`, a submitted step is launched before the previous one is finished: the
    host prepares and queues step N+1 while the device still runs step N (whose sampled tokens
    step N+1 reads on the device). The thread then holds the newest launched step until the next
    submit, or until a `take` wants its output with no step submitted after it (a flush). When
    the next step needs the held one's tokens on the host (penalties), the held one is finished
    first."""

    _STOP = None
    _FLUSH = "flush"

    def __init__(self, worker: Worker, launch_ahead: bool = False) -> None:
        self.worker = worker
        self.launch_ahead = launch_ahead
        # Only the engine core's thread changes these two and `_holds_newest`.
        self.num_pending = 0  # submitted, not taken
        self._num_coming = 0  # submitted, not taken, and posted (or to be) without a flush
        self._holds_newest = False  # the thread holds the newest submitted step (launch ahead)
        self._inputs: queue.SimpleQueue[SchedulerOutput | str | None] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[ModelRunnerOutput | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm_lite-step")
        self._thread.start()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.num_pending += 1
        if not self.launch_ahead or self._holds_newest:  # this submit makes the thread post one
            self._num_coming += 1
        self._holds_newest = self.launch_ahead
        self._inputs.put(scheduler_output)

    def take(self) -> ModelRunnerOutput:
        assert self.num_pending > 0, "no submitted step to take"
        if not self._num_coming:  # the thread holds the step whose output is wanted
            self._inputs.put(self._FLUSH)
            self._holds_newest = False
            self._num_coming += 1
        output = self._outputs.get()
        self.num_pending -= 1
        self._num_coming -= 1
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
        held: _Held | None = None
        while True:
            item = self._inputs.get()
            if item is self._STOP:
                if isinstance(held, LaunchedStep):
                    self._finish(held)  # its device work completes before the thread ends
                return
            if item is self._FLUSH:
                if held is not None:
                    self._outputs.put(self._finish(held))
                held = None
                continue
            if held is not None and self.worker.needs_sampled_tokens_on_host():
                self._outputs.put(self._finish(held))
                held = None
            launched = self._launch(item)
            if held is not None:
                self._outputs.put(self._finish(held))
            if self.launch_ahead:
                held = launched
            else:
                self._outputs.put(self._finish(launched))

    def _launch(self, scheduler_output: SchedulerOutput) -> _Held:
        try:
            return self.worker.launch(scheduler_output)
        except BaseException as exc:  # handed to the engine core's thread, which raises it
            return exc

    def _finish(self, held: _Held) -> ModelRunnerOutput | BaseException:
        if isinstance(held, BaseException):
            return held
        try:
            return self.worker.finish(held)
        except BaseException as exc:
            return exc
