from __future__ import annotations

import numpy as np

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.wire import FinishReason
from vllm_lite.sampling_params import SamplingParams
from scheduler_fakes import distinct_prompt


def make_scheduler(num_blocks: int = 64, max_tokens: int = 64, max_seqs: int = 8,
                   chunked: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, max_tokens, 256, chunked),
                     CacheConfig(4, num_blocks, None, True), num_blocks)


def make_request(request_id: str, num_prompt: int, max_tokens: int = 4, **params) -> Request:
    return Request(request_id, distinct_prompt(request_id, num_prompt), SamplingParams(**params), (7,), max_tokens)


def step(scheduler: Scheduler, token: int = 1):
    """Schedule, then pretend every row that completed its known tokens sampled `token`."""
    out = scheduler.schedule()
    ids = [r.req_id for r in out.scheduled_new_reqs] + out.scheduled_cached_reqs.req_ids
    num_sampled = np.array([int(scheduler.requests[i].num_computed_tokens == scheduler.requests[i].num_tokens)
                            for i in ids], dtype=np.int32)
    sampled = np.full((len(ids), 1), token, dtype=np.int32)
    return out, scheduler.update_from_output(out, ids, sampled, num_sampled)


def test_prefill_and_decode_share_one_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    step(scheduler)
    scheduler.add_request(make_request("b", 6))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    assert out.scheduled_cached_reqs.req_ids == ["a"] and out.scheduled_new_reqs[0].req_id == "b"


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = make_scheduler(max_tokens=8)
    scheduler.add_request(make_request("a", 20))
    budgets = []
    for _ in range(3):
        out, outputs = step(scheduler)
        budgets.append(out.num_scheduled_tokens["a"])
    assert budgets == [8, 8, 4]
    assert outputs.req_ids == ["a"]  # only the step that finished the prompt samples


def test_no_chunking_waits_for_a_whole_prompt() -> None:
    scheduler = make_scheduler(max_tokens=8, chunked=False)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 6}


def test_stops_on_eos_max_tokens_and_stop_token() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", 3, max_tokens=10))
    scheduler.add_request(make_request("len", 3, max_tokens=2, ignore_eos=True))
    scheduler.add_request(make_request("stop", 3, max_tokens=10, stop_token_ids=[7], ignore_eos=True))
    _, outputs = step(scheduler, token=7)
    finished = {f.request_id: (f.finish_reason, f.stop_reason) for f in outputs.finished}
    assert finished == {"eos": (FinishReason.STOP, None), "stop": (FinishReason.STOP, 7)}
    _, outputs = step(scheduler, token=7)
    assert [(f.request_id, f.finish_reason) for f in outputs.finished] == [("len", FinishReason.LENGTH)]
    assert not scheduler.has_unfinished_requests()


def test_min_tokens_holds_back_eos() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=10, min_tokens=3))
    reasons = [step(scheduler, token=7)[1].finished for _ in range(3)]
    assert reasons[0] == [] and reasons[1] == [] and reasons[2][0].finish_reason == FinishReason.STOP


def test_preempts_the_most_recently_admitted_request() -> None:
    scheduler = make_scheduler(num_blocks=7)  # 6 usable blocks of 4 tokens
    scheduler.add_request(make_request("old", 8, max_tokens=8))
    scheduler.add_request(make_request("new", 8, max_tokens=8))
    step(scheduler)  # 2 + 2 blocks; the 13th token of each needs a 4th block: 8 > 6
    preempted = set()
    for _ in range(6):
        out, _ = step(scheduler)
        preempted |= out.preempted_req_ids
    assert preempted == {"new"} and scheduler.num_preemptions >= 1
    assert scheduler.requests["old"].status.name == "RUNNING"


def test_abort_frees_blocks_and_reports_to_workers() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9))
    scheduler.add_request(make_request("b", 3))
    step(scheduler)
    scheduler.abort_requests(["a", "missing"])
    out, _ = step(scheduler)
    assert "a" in out.finished_req_ids
    scheduler.abort_requests(["b"])
    stats = scheduler.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_max_num_seqs_limits_admission() -> None:
    scheduler = make_scheduler(max_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(str(i), 2))
    out, _ = step(scheduler)
    assert len(out.scheduled_new_reqs) == 2 and len(scheduler.waiting) == 1


def test_finished_ids_reach_the_next_nonempty_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=1))
    step(scheduler)  # "a" finishes
    assert scheduler.schedule().is_empty  # nothing to run: workers see nothing this step
    scheduler.add_request(make_request("b", 3))
    out, _ = step(scheduler)
    assert "a" in out.finished_req_ids


def test_prefix_lookup_of_a_blocked_request_is_kept_and_counted_once() -> None:
    """A request that cannot be admitted for many steps (no blocks) is looked up once per change
    of the cached set, and counted in the prefix-cache stats once, when it is admitted."""
    scheduler = make_scheduler(num_blocks=9, max_tokens=64)  # 8 usable blocks of 4 tokens
    scheduler.add_request(make_request("a", 24, max_tokens=8))  # 6 blocks, 8 with its outputs
    step(scheduler)
    blocked = make_request("b", 12, max_tokens=4)
    scheduler.add_request(blocked)
    kv = scheduler.kv_cache_manager
    lookups = 0
    original = kv._update_block_hashes

    def counting(request, num_known=None):
        nonlocal lookups
        lookups += request is blocked
        original(request, num_known)

    kv._update_block_hashes = counting
    versions = set()
    for _ in range(6):  # "a" decodes; "b" waits for blocks every step
        versions.add(kv.block_pool.cache_version)
        out, _ = step(scheduler)
        assert "b" not in out.num_scheduled_tokens
    assert lookups == len(versions) < 6  # looked up again only after the cached set changed
    assert scheduler.get_stats()["prefix_cache_queries"] == 24
    for _ in range(10):  # "a" finishes and frees its blocks; then "b" is admitted
        step(scheduler)
    assert "b" not in scheduler.requests  # it ran to completion
    assert scheduler.get_stats()["prefix_cache_queries"] == 24 + 12


def test_scheduling_times_come_with_the_first_token() -> None:
    """The engine-core times the metrics need (vLLM's QUEUED / SCHEDULED events): sent once,
    with the request's first output token, on the step's clock."""
    scheduler = make_scheduler()
    request = make_request("a", 6, max_tokens=3)
    scheduler.add_request(request)
    out, outputs = step(scheduler)
    assert outputs.scheduling_times == {"a": (request.queued_ts, request.scheduled_ts)}
    assert 0 < request.queued_ts <= request.scheduled_ts <= outputs.timestamp
    _, later = step(scheduler)
    assert later.scheduling_times == {} and later.timestamp >= outputs.timestamp


def test_long_prefill_token_threshold_caps_prompt_chunks_while_others_wait() -> None:
    """vLLM's long_prefill_token_threshold: while another request is in the engine, a prompt is
    computed at most that many tokens a step; a lone request takes the whole budget."""
    scheduler = Scheduler(SchedulerConfig(8, 64, 256, True, long_prefill_token_threshold=6),
                          CacheConfig(4, 64, None, True), 64)
    scheduler.add_request(make_request("alone", 20))
    assert scheduler.schedule().num_scheduled_tokens == {"alone": 20}
    scheduler = Scheduler(SchedulerConfig(8, 64, 256, True, long_prefill_token_threshold=6),
                          CacheConfig(4, 64, None, True), 64)
    scheduler.add_request(make_request("long", 20))
    scheduler.add_request(make_request("short", 3))
    chunks = []
    for _ in range(4):
        out, _ = step(scheduler)
        chunks.append(out.num_scheduled_tokens)
    assert chunks[0] == {"long": 6, "short": 3}
    assert [c["long"] for c in chunks] == [6, 6, 6, 2]


def test_max_num_active_seqs_limits_the_running_requests() -> None:
    """vLLM's max_num_active_seqs: at most that many requests run (max_num_seqs still sizes the batch)."""
    scheduler = Scheduler(SchedulerConfig(8, 64, 256, True, max_num_active=2), CacheConfig(4, 64, None, True), 64)
    for name in "abcd":
        scheduler.add_request(make_request(name, 3, max_tokens=2))
    out, _ = step(scheduler)
    assert sorted(out.num_scheduled_tokens) == ["a", "b"]
    running = [sorted(step(scheduler)[0].num_scheduled_tokens) for _ in range(4)]
    assert all(len(names) <= 2 for names in running) and ["c", "d"] in running
