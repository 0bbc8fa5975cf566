"""The multiproc executor reads one reply per rank per step. With async scheduling two steps are
in flight, and a rank's reply to the next step may arrive before another rank's reply to this
one: it must be kept for the next step, not taken for this one. A rank's error names the rank that
died, when one did."""

from __future__ import annotations

import multiprocessing
import time
from collections import deque

import numpy as np
import pytest

from vllm_lite.executor import multiproc
from vllm_lite.executor.multiproc import MultiprocExecutor
from vllm_lite.exceptions import EngineDeadError
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


def test_a_rank_s_error_names_the_rank_that_died(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a rank dies mid-step, a surviving rank's collective fails too, and its error (a reset
    connection) may reach the executor before the death watch's notice: the reason must still
    name the dead rank (waiting a moment for its exit to show), and not twice."""
    # A forked child can take more than the executor's 1 s grace to exit on a loaded machine; the
    # wait ends at the exit, so a longer grace costs nothing here.
    monkeypatch.setattr(multiproc, "PEER_DEATH_GRACE_S", 60.0)
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
        monkeypatch.setattr(multiproc, "PEER_DEATH_GRACE_S", 1.0)
        executor._res = ProcessResources(procs=[survivor])  # everyone alive: the error as it came
        start = time.monotonic()
        assert executor._with_dead_ranks("rank 0: boom") == "rank 0: boom"
        assert time.monotonic() - start < 5
    finally:
        survivor.kill()
        survivor.join()
        victim.join()


class _Replies:
    """The executor's reply socket, as far as `_receive_reply` uses it: queued replies, already
    decoded (the codec below passes them through)."""

    def __init__(self, replies: list[WorkerReply]) -> None:
        self.queue = deque(replies)

    def recv_multipart(self, copy: bool = True) -> WorkerReply:
        return self.queue.popleft()

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.queue)


class _PassThrough:
    @staticmethod
    def decode_reply(reply: WorkerReply) -> WorkerReply:
        return reply


def test_a_death_notice_waits_for_the_dead_rank_s_own_error() -> None:
    """A rank that fails sends its error and exits; the death watch's notice of the exit may
    arrive first. The engine's error must still carry the rank's cause."""
    executor = object.__new__(MultiprocExecutor)
    executor._res = ProcessResources(procs=[])
    executor.codec = _PassThrough()
    executor._dead_reason = None
    notice = WorkerReply(error="vllm_lite-rank1 (pid 7) exited with code 1", death_notice=True)
    executor._replies = _Replies([notice, WorkerReply(rank=0), WorkerReply(rank=1, error="rank 1: RuntimeError: boom")])
    with pytest.raises(EngineDeadError, match="rank 1: RuntimeError: boom"):
        executor._receive_reply()
    executor = object.__new__(MultiprocExecutor)  # no error follows: the notice is the reason
    executor._res, executor.codec, executor._dead_reason = ProcessResources(procs=[]), _PassThrough(), None
    executor._replies = _Replies([notice])
    with pytest.raises(EngineDeadError, match="exited with code 1"):
        executor._receive_reply()
