"""The multiproc executor reads one reply per rank per step. With async scheduling two steps are
in flight, and a rank's reply to the next step may arrive before another rank's reply to this
one: it must be kept for the next step, not taken for this one."""

from __future__ import annotations

from collections import deque

import numpy as np

from vllm_lite.executor.multiproc import MultiprocExecutor
from vllm_lite.wire import ModelRunnerOutput, WorkerReply


def executor_reading(replies: list[WorkerReply], world_size: int) -> MultiprocExecutor:
    """A MultiprocExecutor without processes whose reply channel yields `replies` in order."""
    executor = object.__new__(MultiprocExecutor)
    executor.world_size = world_size
    executor._replies_ahead = [deque() for _ in range(world_size)]
    arriving = iter(replies)
    executor._receive_reply = lambda: next(arriving)
    return executor


def output(step: int) -> ModelRunnerOutput:
    return ModelRunnerOutput([f"step{step}"], np.full((1, 1), step, dtype=np.int32), np.ones(1, dtype=np.int32))


def test_a_rank_s_reply_to_the_next_step_waits_for_that_step() -> None:
    replies = [WorkerReply(output(1)), WorkerReply(output(2)),  # rank 0 already answered step 2
               WorkerReply(rank=1, failed={"x": "rank 1: boom"}), WorkerReply(rank=1)]
    executor = executor_reading(replies, world_size=2)
    first = executor.take_model_output()
    assert first.req_ids == ["step1"] and first.failed == {"x": "rank 1: boom"}
    second = executor.take_model_output()
    assert second.req_ids == ["step2"] and not second.failed
