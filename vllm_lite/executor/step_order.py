"""The order in which a worker launches and finishes the steps submitted to it, on both ends of
the channel to it: `StepPipeline` where the worker runs (the uniproc executor's step thread, a
tensor-parallel rank's process), `HeldSteps` on the engine core's side, which tells when taking
an output needs a flush.

Launching ahead (a GPU's order): step N+1 is launched before step N is finished, so the host
prepares and queues N+1 while the device still runs N (N+1 reads N's sampled tokens on the
device). The worker then holds the newest launched step until the next one is submitted, or until
a flush asks for its output (the engine core wants it with no step submitted after it). Where
the next step's sampling reads the last tokens on the host (penalties, bad words), the held step is finished
first. Finishing first (a CPU's order: a launch is the whole forward pass) runs each step whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.wire import ModelRunnerOutput

if TYPE_CHECKING:
    from vllm_lite.worker.model_runner import LaunchedStep
    from vllm_lite.worker.worker import Worker

StepResult = ModelRunnerOutput | BaseException  # a step's output, or what its launch or finish raised


def launches_ahead(device_type: str) -> bool:
    """Whether steps on this device are launched ahead: on a GPU, where a launch returns as soon
    as the work is queued. On a CPU a launch runs the whole forward pass, so the previous step's
    output would wait for it."""
    return device_type == "cuda"


class StepPipeline:
    """Runs the steps given to one worker in order and returns each step's result once it is
    finished: every step gives exactly one result, in submission order. A launch that raises is
    returned at once (after the held step's result), never held: under tensor parallelism the
    other ranks may be waiting in that step's collectives, so the engine core must hear of it
    now."""

    def __init__(self, worker: Worker, launch_ahead: bool) -> None:
        self.worker = worker
        self.launch_ahead = launch_ahead
        self._held: LaunchedStep | None = None

    def run(self, scheduler_output: SchedulerOutput) -> list[StepResult]:
        results: list[StepResult] = []
        if self._held is not None and self.worker.needs_sampled_tokens_on_host():
            results += self.flush()
        try:
            launched = self.worker.launch(scheduler_output)
        except BaseException as exc:  # handed to the engine core, which raises it
            return results + self.flush() + [exc]
        results += self.flush()
        if self.launch_ahead:
            self._held = launched
        else:
            results.append(self._finish(launched))
        return results

    def flush(self) -> list[StepResult]:
        """The held step's result (finished now), if a step is held."""
        held, self._held = self._held, None
        return [] if held is None else [self._finish(held)]

    def stop(self) -> None:
        """Lets the held step's device work complete (it may be writing the KV cache)."""
        self.flush()

    def _finish(self, launched: LaunchedStep) -> StepResult:
        try:
            return self.worker.finish(launched)
        except BaseException as exc:
            return exc


class HeldSteps:
    """The engine core's count of the steps it submitted and has not taken, and whether the worker
    holds the newest of them (launching ahead): a take with no step submitted after the held one
    must ask the worker for a flush first. Used from the engine core's thread only."""

    def __init__(self, launch_ahead: bool) -> None:
        self.launch_ahead = launch_ahead
        self.num_pending = 0  # submitted, not taken
        self._num_coming = 0  # of those, the results the worker gives (or gave) without a flush
        self._holds_newest = False

    def submitted(self) -> None:
        self.num_pending += 1
        if not self.launch_ahead or self._holds_newest:  # this step makes the worker give one
            self._num_coming += 1
        self._holds_newest = self.launch_ahead

    def take_needs_flush(self) -> bool:
        """Called before each take: whether to send the worker a flush (then counted as sent)."""
        assert self.num_pending > 0, "no submitted step to take"
        if self._num_coming:
            return False
        self._holds_newest = False
        self._num_coming += 1
        return True

    def taken(self) -> None:
        self.num_pending -= 1
        self._num_coming -= 1
