"""Async scheduling in the scheduler alone: step N+1 is scheduled before step N's output is
applied, as the engine core does it. A fake worker keeps its own token counts (as the model
runner's persistent batch does) and samples a row when all its known tokens are computed."""

from __future__ import annotations

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.kv_cache_manager import block_key, root_block_key
from vllm_lite.core.request import Request, RequestStatus
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import EngineCoreOutputs, FinishReason
from scheduler_fakes import FakeWorker, distinct_prompt

BLOCK_SIZE = 4
EOS = 7


def make_scheduler(num_blocks: int = 64, async_scheduling: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, 256, True, async_scheduling),
                     CacheConfig(BLOCK_SIZE, num_blocks, None, True), num_blocks)


def make_request(request_id: str, num_prompt: int, max_tokens: int, **params) -> Request:
    return Request(request_id, distinct_prompt(request_id, num_prompt), SamplingParams(**params), (EOS,), max_tokens)


def update(scheduler: Scheduler, out: SchedulerOutput, result) -> EngineCoreOutputs:
    return scheduler.update_from_output(out, *result)


def test_the_next_step_computes_the_placeholder() -> None:
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request(make_request("a", 5, max_tokens=4, ignore_eos=True))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1)
    request = scheduler.requests["a"]
    assert request.num_output_placeholders == 1 and request.num_tokens == 5
    s2 = scheduler.schedule()  # before step 1's output
    assert s2.num_scheduled_tokens == {"a": 1} and s2.scheduled_cached_reqs.num_computed_tokens == [5]
    r2 = worker.execute(s2, default=2)
    assert request.num_output_placeholders == 2
    outputs = update(scheduler, s1, r1)
    assert outputs.req_ids == ["a"] and outputs.new_token_ids.tolist() == [1]
    assert request.num_output_placeholders == 1 and request.all_token_ids[-1] == 1
    update(scheduler, s2, r2)
    assert request.num_output_placeholders == 0 and request.all_token_ids[5:].tolist() == [1, 2]


def test_no_step_is_scheduled_past_max_tokens() -> None:
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request(make_request("a", 5, max_tokens=2, ignore_eos=True))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1)
    s2 = scheduler.schedule()
    r2 = worker.execute(s2)
    update(scheduler, s1, r1)
    assert scheduler.schedule().is_empty  # the token in flight is the last one
    outputs = update(scheduler, s2, r2)
    assert [(f.request_id, f.finish_reason) for f in outputs.finished] == [("a", FinishReason.LENGTH)]
    assert not scheduler.has_unfinished_requests()


def test_a_finished_request_s_token_in_flight_is_discarded_even_if_its_id_returns() -> None:
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request(make_request("a", 5, max_tokens=10))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1, default=EOS)
    s2 = scheduler.schedule()
    r2 = worker.execute(s2, default=9)  # computed for a request that is already done
    outputs = update(scheduler, s1, r1)
    assert [(f.request_id, f.finish_reason) for f in outputs.finished] == [("a", FinishReason.STOP)]
    assert scheduler.stale_req_ids == {"a": 1}  # the one step in flight
    scheduler.add_request(make_request("a", 3, max_tokens=10))  # the id reused at once
    s3 = scheduler.schedule()
    assert "a" in s3.finished_req_ids and [n.req_id for n in s3.scheduled_new_reqs] == ["a"]
    r3 = worker.execute(s3, default=5)
    outputs = update(scheduler, s2, r2)
    assert outputs.req_ids == [] and not outputs.finished
    reused = scheduler.requests["a"]
    assert reused.num_tokens == 3 and reused.num_output_placeholders == 1
    outputs = update(scheduler, s3, r3)
    assert outputs.req_ids == ["a"] and reused.all_token_ids[3:].tolist() == [5]


def test_an_abort_with_a_token_in_flight_discards_the_token() -> None:
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request(make_request("a", 5, max_tokens=10))
    scheduler.add_request(make_request("b", 5, max_tokens=10))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1)
    update(scheduler, s1, r1)
    s2 = scheduler.schedule()
    r2 = worker.execute(s2)
    scheduler.abort_requests(["a"])
    outputs = update(scheduler, s2, r2)
    assert outputs.req_ids == ["b"]
    assert "a" not in scheduler.requests and not scheduler.stale_req_ids


def test_a_preempted_request_keeps_its_token_in_flight() -> None:
    # 4 usable blocks of 4: two 7-token prompts take 2 each; the third token of either needs a 3rd
    scheduler, worker = make_scheduler(num_blocks=5), FakeWorker()
    scheduler.add_request(make_request("a", 7, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", 7, max_tokens=8, ignore_eos=True))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1, default=3)
    s2 = scheduler.schedule()  # position 7 of both: still inside their second blocks
    assert s2.num_scheduled_tokens == {"a": 1, "b": 1}
    r2 = worker.execute(s2, tokens={"a": 4, "b": 5})
    update(scheduler, s1, r1)
    s3 = scheduler.schedule()  # a's position 8 needs a block: b, with a token in flight, yields
    assert s3.preempted_req_ids == {"b"} and s3.num_scheduled_tokens == {"a": 1}
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    r3 = worker.execute(s3)
    outputs = update(scheduler, s2, r2)
    assert outputs.req_ids == ["a", "b"] and outputs.new_token_ids.tolist() == [4, 5]
    assert b.all_token_ids[7:].tolist() == [3, 5] and b.num_output_placeholders == 0
    assert b in scheduler.waiting
    update(scheduler, s3, r3)


def test_a_preempted_request_that_ends_on_its_token_in_flight_leaves_the_queue() -> None:
    scheduler, worker = make_scheduler(num_blocks=5), FakeWorker()
    scheduler.add_request(make_request("a", 7, max_tokens=8, ignore_eos=True))
    scheduler.add_request(make_request("b", 7, max_tokens=8))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1, default=3)
    s2 = scheduler.schedule()
    r2 = worker.execute(s2, tokens={"a": 4, "b": EOS})
    update(scheduler, s1, r1)
    s3 = scheduler.schedule()
    assert s3.preempted_req_ids == {"b"}
    outputs = update(scheduler, s2, r2)
    assert [(f.request_id, f.finish_reason) for f in outputs.finished] == [("b", FinishReason.STOP)]
    assert "b" not in scheduler.requests and not any(r.request_id == "b" for r in scheduler.waiting)


def test_a_block_ending_in_a_placeholder_is_cached_once_its_token_is_known() -> None:
    """Before a prefix lookup (a request waits: "b", then "c") the blocks a running request
    filled enter the cache, but not one whose last token is a placeholder: that one at the
    first lookup after its token is known."""
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request(make_request("a", 7, max_tokens=10, ignore_eos=True))
    kv = scheduler.kv_cache_manager
    s1 = scheduler.schedule()
    assert kv.num_cached_blocks["a"] == 1  # (its first block, at admission)
    r1 = worker.execute(s1, default=3)
    scheduler.add_request(make_request("b", 3, max_tokens=4))
    s2 = scheduler.schedule()  # slots for position 7 (the placeholder): block 1 is full
    assert "b" in s2.num_scheduled_tokens and kv.num_cached_blocks["a"] == 1
    r2 = worker.execute(s2, default=4)
    update(scheduler, s1, r1)
    scheduler.add_request(make_request("c", 3, max_tokens=4))
    scheduler.schedule()
    assert kv.num_cached_blocks["a"] == 2
    request = scheduler.requests["a"]
    tokens = request.all_token_ids
    expected = block_key(block_key(root_block_key(None), tokens[:4].tobytes()), tokens[4:8].tobytes())
    assert request.block_hashes[1] == expected and tokens[7] == 3
    assert kv.block_pool.get_cached_block(expected) is kv.req_to_blocks["a"][1]
    update(scheduler, s2, r2)


def test_sync_scheduling_never_schedules_a_placeholder() -> None:
    """Without async scheduling a step's sampled token is a placeholder only while that step
    runs: the next step is scheduled after its output, on the known token."""
    scheduler, worker = make_scheduler(async_scheduling=False), FakeWorker()
    scheduler.add_request(make_request("a", 5, max_tokens=4, ignore_eos=True))
    s1 = scheduler.schedule()
    request = scheduler.requests["a"]
    assert request.num_output_placeholders == 1
    update(scheduler, s1, worker.execute(s1))
    assert request.num_output_placeholders == 0 and request.num_tokens == 6
    s2 = scheduler.schedule()
    assert s2.num_scheduled_tokens == {"a": 1} and s2.scheduled_cached_reqs.num_computed_tokens == [5]


def test_a_request_failing_while_its_next_step_is_in_flight_is_freed_once() -> None:
    """The worker fails "a" in step 1 while step 2 (a placeholder for it) is in flight; its id is
    reused at once. "a" is freed and reported once, its blocks leave the prefix cache; what step 2
    returns for it (a row, the same failure again) is discarded; "b" and the new "a" go on."""
    scheduler, worker = make_scheduler(), FakeWorker()
    scheduler.add_request(make_request("a", 8, max_tokens=10))
    scheduler.add_request(make_request("b", 5, max_tokens=10))
    s1 = scheduler.schedule()
    r1 = worker.execute(s1, tokens={"b": 3})
    s2 = scheduler.schedule()
    assert s2.num_scheduled_tokens == {"a": 1, "b": 1}
    r2 = worker.execute(s2, tokens={"a": 9, "b": 4})
    kv = scheduler.kv_cache_manager
    cached_before = len(kv.block_pool.cached_blocks)
    outputs = scheduler.update_from_output(s1, *r1, failed={"a": "RuntimeError: boom"})
    assert outputs.req_ids == ["b"] and outputs.new_token_ids.tolist() == [3]
    assert scheduler.take_step_failures() == {"a": "in the worker: RuntimeError: boom"}
    assert "a" not in scheduler.requests and [r.request_id for r in scheduler.running] == ["b"]
    assert scheduler.stale_req_ids == {"a": 1}  # step 2 still returns a row for it
    assert len(kv.block_pool.cached_blocks) < cached_before  # its full blocks left the cache
    scheduler.add_request(make_request("a", 3, max_tokens=10))  # the id reused at once
    s3 = scheduler.schedule()
    assert "a" in s3.finished_req_ids and [n.req_id for n in s3.scheduled_new_reqs] == ["a"]
    r3 = worker.execute(s3, default=5)
    outputs = scheduler.update_from_output(s2, *r2, failed={"a": "RuntimeError: boom"})
    assert outputs.req_ids == ["b"] and outputs.new_token_ids.tolist() == [4]
    assert scheduler.take_step_failures() == {} and not scheduler.stale_req_ids
    reused = scheduler.requests["a"]
    assert reused.num_tokens == 3 and reused.status == RequestStatus.RUNNING
    outputs = scheduler.update_from_output(s3, *r3)
    assert outputs.req_ids == ["b", "a"] and reused.all_token_ids[3:].tolist() == [5]
    assert scheduler.requests["b"].all_token_ids[5:].tolist() == [3, 4, 5]


def test_a_grammar_row_failure_frees_the_request_when_its_step_is_scheduled() -> None:
    """Filling its bitmask row failed: the request samples unconstrained in that step (whose row
    for it is then stale) and is failed at once, with the step counted in flight."""
    class Grammar:
        def is_ready(self) -> bool:
            return True

        error = None

    class FailingManager:
        def grammar_bitmask(self, grammars):
            raise RuntimeError("boom")

    scheduler = Scheduler(SchedulerConfig(8, 64, 256, True, True), CacheConfig(BLOCK_SIZE, 64, None, True), 64,
                          FailingManager())
    request = make_request("g", 5, max_tokens=4)
    request.structured_output_request = Grammar()
    scheduler.add_request(request)
    scheduler.add_request(make_request("b", 5, max_tokens=4))
    worker = FakeWorker()
    s1 = scheduler.schedule()
    assert s1.num_scheduled_tokens == {"g": 5, "b": 5} and s1.structured_output_req_ids == ()
    assert "g" not in scheduler.requests and scheduler.stale_req_ids == {"g": 1}
    assert list(scheduler.take_step_failures()) == ["g"]
    outputs = scheduler.update_from_output(s1, *worker.execute(s1))
    assert outputs.req_ids == ["b"] and not scheduler.stale_req_ids
    assert "g" in scheduler.schedule().finished_req_ids
