"""The order a worker launches and finishes steps in (`executor.step_order`), on a worker that
records its calls: the engine core's side (`HeldSteps`) and the worker's (`StepPipeline`) give
each step exactly one result, in order, whatever the sequence of submits and takes."""

from __future__ import annotations

import random
from collections import deque

import pytest

from vllm_lite.executor.step_order import HeldSteps, StepPipeline, StepResult


class RecordingWorker:
    """Steps are ints; a launch of a negative one raises; step n's output is `n`."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.penalized = False

    def launch(self, step: int) -> int:
        self.calls.append(f"launch {step}")
        if step < 0:
            raise RuntimeError(f"launch {step} failed")
        return step

    def finish(self, step: int) -> int:
        self.calls.append(f"finish {step}")
        return step

    def needs_sampled_tokens_on_host(self) -> bool:
        return self.penalized


def outputs_of(results: list[StepResult]) -> list[int | str]:
    return [str(r) if isinstance(r, BaseException) else r for r in results]


def test_launching_ahead_finishes_a_step_after_the_next_launch_or_at_a_flush() -> None:
    worker = RecordingWorker()
    pipeline = StepPipeline(worker, launch_ahead=True)
    assert pipeline.run(1) == []
    assert pipeline.run(2) == [1]
    assert worker.calls == ["launch 1", "launch 2", "finish 1"]
    assert pipeline.flush() == [2] and pipeline.flush() == []
    worker.penalized = True  # the next launch reads the held step's tokens on the host
    assert pipeline.run(3) == [] and pipeline.run(4) == [3]
    assert worker.calls[-3:] == ["launch 3", "finish 3", "launch 4"]
    pipeline.stop()
    assert worker.calls[-1] == "finish 4"


def test_finishing_first_answers_every_step_at_once() -> None:
    worker = RecordingWorker()
    pipeline = StepPipeline(worker, launch_ahead=False)
    assert pipeline.run(1) == [1] and pipeline.run(2) == [2] and pipeline.flush() == []
    assert worker.calls == ["launch 1", "finish 1", "launch 2", "finish 2"]


@pytest.mark.parametrize("launch_ahead", [True, False])
def test_a_launch_that_raises_is_answered_at_once_after_the_held_step(launch_ahead: bool) -> None:
    """Not held: under tensor parallelism the other ranks may wait in that step's collectives,
    and the engine core waits for their replies to the step before it."""
    pipeline = StepPipeline(RecordingWorker(), launch_ahead)
    first = pipeline.run(1)
    assert first == ([] if launch_ahead else [1])
    assert outputs_of(first + pipeline.run(-2)) == [1, "launch -2 failed"]
    assert pipeline.flush() == []


@pytest.mark.parametrize("launch_ahead", [True, False])
def test_any_sequence_of_submits_and_takes_gets_each_step_s_result_in_order(launch_ahead: bool) -> None:
    """The engine core's protocol (submit, take the oldest) against the worker's, as the step
    thread and the ranks run them; some launches raise, some steps need the host's tokens."""
    rng = random.Random(0)
    worker = RecordingWorker()
    pipeline, held = StepPipeline(worker, launch_ahead), HeldSteps(launch_ahead)
    given: deque[StepResult] = deque()  # what the worker handed back, not taken yet
    submitted: deque[int] = deque()
    next_step, taken = 1, 0
    while taken < 300:
        if submitted and (len(submitted) == 2 or rng.random() < 0.5):  # at most two in flight
            if held.take_needs_flush():
                given += pipeline.flush()
            assert given, "a take found no result coming"
            result = given.popleft()
            held.taken()
            expected = submitted.popleft()
            assert outputs_of([result]) == ([f"launch {expected} failed"] if expected < 0 else [expected])
            taken += 1
        else:
            step = -next_step if rng.random() < 0.1 else next_step
            worker.penalized = rng.random() < 0.2
            held.submitted()
            submitted.append(step)
            given += pipeline.run(step)
            next_step += 1
    assert held.num_pending == len(submitted)
