"""The multiproc executor reads one reply per rank per step. With async scheduling two steps are
in flight, and a rank's reply to the next step may arrive before another rank's reply to this
one: it must be kept for the next step, not taken for this one. A rank's error names the rank that
died, when one did."""

from __future__ import annotations

import multiprocessing
import time
from collections import deque

import numpy as np

from vllm_lite.executor.multiproc import MultiprocExecutor
from vllm_lite.executor.step_order import HeldSteps
from vllm_lite.lifecycle import ProcessResources
from vllm_lite.wire import ModelRunnerOutput, WorkerReply


def executor_reading(replies: list[WorkerReply], world_size: int, steps: int) -> MultiprocExecutor:
    """A MultiprocExecutor without processes, `steps` steps submitted (ranks finishing each
    step first), whose reply channel yields `replies` in order."""
    executor = object.__new__(MultiprocExecutor)
    executor.world_size = world_size
    executor.held_steps = HeldSteps(launch_ahead=False)
    for _ in range(steps):
        executor.held_steps.submitted()
    executor._replies_ahead = [deque() for _ in range(world_size)]
    arriving = iter(replies)
    executor._receive_reply = lambda: next(arriving)
    return executor


def output(step: int) -> ModelRunnerOutput:
    return ModelRunnerOutput([f"step{step}"], np.full((1, 1), step, dtype=np.int32), np.ones(1, dtype=np.int32))


def test_a_rank_s_reply_to_the_next_step_waits_for_that_step() -> None:
    replies = [WorkerReply(output(1)), WorkerReply(output(2)),  # rank 0 already answered step 2
               WorkerReply(rank=1, failed={"x": "rank 1: boom"}), WorkerReply(rank=1)]
    executor = executor_reading(replies, world_size=2, steps=2)
    first = executor.take_model_output()
    assert first.req_ids == ["step1"] and first.failed == {"x": "rank 1: boom"}
    second = executor.take_model_output()
    assert second.req_ids == ["step2"] and not second.failed


def _exits_at_once() -> None:
    pass


def _sleeps() -> None:
    time.sleep(30)


def test_a_rank_s_error_names_the_rank_that_died() -> None:
    """When a rank dies mid-step, a surviving rank's collective fails too, and its error (a reset
    connection) may reach the executor before the death watch's notice: the reason must still
    name the dead rank (waiting a moment for its exit to show), and not twice."""
    ctx = multiprocessing.get_context("fork")  # children that run no torch: fork starts them at once
    survivor = ctx.Process(target=_sleeps, name="vllm_lite-rank0", daemon=True)
    victim = ctx.Process(target=_exits_at_once, name="vllm_lite-rank1", daemon=True)
    survivor.start()
    victim.start()
    try:
        executor = object.__new__(MultiprocExecutor)
        executor._res = ProcessResources(procs=[survivor, victim])
        reason = executor._with_dead_ranks("rank 0: Connection reset by peer")
        assert reason.startswith("vllm_lite-rank1 (pid") and reason.endswith("; then rank 0: Connection reset by peer")
        already_named = "vllm_lite-rank1 (pid 1) exited with code -9"
        assert executor._with_dead_ranks(already_named) == already_named
        victim.join()
        executor._res = ProcessResources(procs=[survivor])  # everyone alive: the error as it came
        start = time.monotonic()
        assert executor._with_dead_ranks("rank 0: boom") == "rank 0: boom"
        assert time.monotonic() - start < 5
    finally:
        survivor.kill()
        survivor.join()
        victim.join()
