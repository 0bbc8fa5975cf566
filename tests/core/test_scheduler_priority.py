"""vLLM's priority scheduling policy: waiting requests are admitted by (priority, arrival), lower
first; running ones are served in that order and the least urgent is the one preempted when
blocks run out (fcfs: the most recently admitted). Under fcfs a priority other than 0 is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from scheduler_fakes import distinct_prompt


def make_scheduler(policy: str, num_blocks: int = 64, max_seqs: int = 8, max_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, max_tokens, 256, True, policy=policy),
                     CacheConfig(4, num_blocks, None, True), num_blocks)


def make_request(request_id: str, num_prompt: int, priority: int, arrival: float, max_tokens: int = 8) -> Request:
    return Request(request_id, distinct_prompt(request_id, num_prompt), SamplingParams(ignore_eos=True), (7,),
                   max_tokens, priority=priority, arrival_time=arrival)


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    ids = [r.req_id for r in out.scheduled_new_reqs] + out.scheduled_cached_reqs.req_ids
    num_sampled = np.array([int(scheduler.requests[i].num_computed_tokens == scheduler.requests[i].num_tokens)
                            for i in ids], dtype=np.int32)
    scheduler.update_from_output(out, ids, np.ones((len(ids), 1), dtype=np.int32), num_sampled)
    return out


def test_waiting_requests_are_admitted_most_urgent_first() -> None:
    scheduler = make_scheduler("priority", max_seqs=2)
    for request_id, priority, arrival in (("late-low", 5, 1.0), ("early-low", 5, 0.5), ("urgent", -1, 2.0),
                                          ("mid", 0, 3.0)):
        scheduler.add_request(make_request(request_id, 4, priority, arrival))
    out = step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["urgent", "mid"]
    assert [r.request_id for r in scheduler.waiting] == ["early-low", "late-low"]


def test_fcfs_admits_in_arrival_order_and_refuses_priorities() -> None:
    scheduler = make_scheduler("fcfs", max_seqs=2)
    scheduler.add_request(make_request("first", 4, 0, 2.0))
    scheduler.add_request(make_request("second", 4, 0, 1.0))
    assert [r.req_id for r in step(scheduler).scheduled_new_reqs] == ["first", "second"]
    with pytest.raises(ValueError, match="priority=3 needs the priority scheduling policy"):
        scheduler.add_request(make_request("urgent", 4, 3, 0.0))


@pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "late-urgent")])
def test_the_least_urgent_running_request_is_preempted(policy: str, victim: str) -> None:
    """Three requests of 4 prompt tokens in 7 usable blocks of 4: each needs a second block at its
    5th token and a third at its 9th; the pool runs out and one running request must go."""
    scheduler = make_scheduler(policy, num_blocks=8, max_tokens=64)
    priorities = {"low": 9, "urgent": 0, "late-urgent": 0} if policy == "priority" else dict.fromkeys(
        ("low", "urgent", "late-urgent"), 0)
    for request_id, arrival in (("low", 0.0), ("urgent", 1.0), ("late-urgent", 2.0)):
        scheduler.add_request(make_request(request_id, 4, priorities[request_id], arrival, max_tokens=12))
    preempted = set()
    for _ in range(12):
        preempted |= step(scheduler).preempted_req_ids
        if preempted:
            break
    assert preempted == {victim}
    assert scheduler.waiting[0].request_id == victim


def test_llm_serves_by_priority_end_to_end(tiny_llama: Path) -> None:
    """Through the input processor, the wire and the engine core: one sequence at a time, the
    requests finish in priority order, whatever order they were added in."""
    from llm_factory import make_llm

    llm = make_llm(tiny_llama, scheduling_policy="priority", max_num_seqs=1)
    try:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for request_id, priority in (("p5", 5), ("p0", 0), ("p1", 1), ("p-2", -2)):
            engine.add_request(request_id, {"prompt_token_ids": [3, 4, 5]}, params, priority)
        finished = []
        while len(finished) < 4:
            finished += [output.request_id for output in engine.step() if output.finished]
        assert finished == ["p-2", "p0", "p1", "p5"]
        outputs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 2, params, use_tqdm=False, priority=[1, 0])
        assert [list(o.outputs[0].token_ids) for o in outputs][0] == list(outputs[1].outputs[0].token_ids)
        with pytest.raises(ValueError, match="priority has 1 entries but there are 2 prompts"):
            llm.generate(["a", "b"], params, use_tqdm=False, priority=[1])
    finally:
        llm.shutdown()


def test_priority_must_be_a_64_bit_int(tiny_llama: Path) -> None:
    from llm_factory import make_llm

    llm = make_llm(tiny_llama, scheduling_policy="priority", multiprocess=True)
    try:
        params = SamplingParams(max_tokens=1)
        with pytest.raises(ValueError, match=r"priority must be within \[-2\*\*63, 2\*\*63 - 1\]"):
            llm.generate("x", params, use_tqdm=False, priority=1 << 70)
        with pytest.raises(TypeError, match="priority must be an int, got float"):
            llm.generate("x", params, use_tqdm=False, priority=[0.5])
        assert llm.generate("x", params, use_tqdm=False, priority=-(1 << 63))[0].finished  # the engine goes on
    finally:
        llm.shutdown()
