"""The running part of a step computed with array operations (`_schedule_running_at_once`)
decides exactly what the per-request loop decides: two schedulers, one that always tries the
array path and one that never does, run the same random traffic (admissions, prefix-cache hits,
chunked prefills, EOS, max_tokens, aborts, KV pressure with preemption, one or two steps in
flight) and must agree on every step's output and on every block they hold. The array path
runs with the token store's numpy loops and, where csrc is built, its C loops; the loop's
scheduler keeps the numpy ones."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.kv_cache_manager import KVCacheManager
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.sampling_params import SamplingParams
from scheduler_fakes import EITHER_LOOPS, FakeWorker

BLOCK_SIZE = 4
EOS = 7


class CountingScheduler(Scheduler):
    """Counts how each step's running part was decided, so the test knows it ran both paths."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at_once_steps = 0
        self.loop_steps = 0
        self.lookups = 0

    def _register_filled_blocks(self):
        """Checks that a lookup finds every running request's blocks full of scheduled, known
        tokens registered (what registering each block in the step it filled would give)."""
        super()._register_filled_blocks()
        kv = self.kv_cache_manager
        if kv.enable_caching:
            self.lookups += 1
            assert [kv.num_cached_blocks[r.request_id] for r in self.running] == \
                [min(r.num_computed_tokens, r.num_tokens) // BLOCK_SIZE for r in self.running]

    def _schedule_running_at_once(self, budget):
        result = super()._schedule_running_at_once(budget)
        self.at_once_steps += result is not None
        self.loop_steps += result is None
        return result


def make_scheduler(at_once: bool, num_blocks: int, async_scheduling: bool, caching: bool,
                   native: bool = False) -> CountingScheduler:
    scheduler = CountingScheduler(SchedulerConfig(24, 48, 128, True, async_scheduling),
                                  CacheConfig(BLOCK_SIZE, num_blocks, None, caching), num_blocks, native_loops=native)
    scheduler.AT_ONCE_MIN_RUNNING = 0 if at_once else 1 << 30
    return scheduler


def make_request(request_id: str, prompt: np.ndarray, max_tokens: int, ignore_eos: bool) -> Request:
    return Request(request_id, prompt, SamplingParams(ignore_eos=ignore_eos), (EOS,), max_tokens)


def summary(out: SchedulerOutput) -> tuple:
    cached = out.scheduled_cached_reqs
    assert cached.num_new_blocks.dtype == cached.new_block_ids.dtype == np.int32
    assert int(cached.num_new_blocks.sum()) == len(cached.new_block_ids)
    return (list(out.num_scheduled_tokens.items()), out.total_num_scheduled_tokens,
            [(new.req_id, new.block_ids, new.num_computed_tokens, new.token_ids.tolist())
             for new in out.scheduled_new_reqs],
            cached.req_ids, [ids.tolist() for ids in cached.new_block_ids_of_each()], list(cached.num_computed_tokens),
            sorted(out.finished_req_ids), sorted(out.preempted_req_ids))


def held_state(scheduler: Scheduler) -> tuple:
    kv = scheduler.kv_cache_manager
    return ({req_id: [block.block_id for block in blocks] for req_id, blocks in kv.req_to_blocks.items()},
            dict(kv.num_cached_blocks), kv.get_num_free_blocks(),
            {key: block.block_id for key, block in kv.block_pool.cached_blocks.items()},
            [(r.request_id, r.num_computed_tokens, r.num_tokens_with_placeholders, r.num_tokens)
             for r in scheduler.running])


def assert_tracked_counts_true(kv: KVCacheManager) -> None:
    """The block counts the array path reads (kept up to date, not read again each step) equal
    the manager's own (0 for a request that has left)."""
    tracked = kv.tracked
    assert tracked.held.tolist() == [len(kv.req_to_blocks.get(r, ())) for r in tracked.req_ids]
    assert tracked.cached.tolist() == [kv.num_cached_blocks.get(r, 0) for r in tracked.req_ids]


@EITHER_LOOPS
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks", [400, 70])  # 70: preemption under KV pressure
def test_array_path_decides_what_the_loop_decides(async_scheduling: bool, caching: bool, num_blocks: int,
                                                  native: bool) -> None:
    rng = np.random.default_rng(num_blocks + 2 * async_scheduling + caching)
    pair = [make_scheduler(True, num_blocks, async_scheduling, caching, native),
            make_scheduler(False, num_blocks, async_scheduling, caching)]
    workers = [FakeWorker(), FakeWorker()]
    shared_prefix = rng.integers(100, 1000, size=12).astype(np.int32)
    in_flight: list[list] = [[], []]
    counts_when_scheduled: list[tuple[SchedulerOutput, dict[str, int]]] = []
    next_id = 0
    for step in range(160):
        if step < 100 and rng.random() < 0.5:  # admissions: some share a prefix (cache hits)
            for _ in range(int(rng.integers(1, 4))):
                tail = rng.integers(100, 1000, size=int(rng.integers(1, 20))).astype(np.int32)
                prompt = np.concatenate([shared_prefix, tail]) if rng.random() < 0.5 else tail
                max_tokens, ignore_eos = int(rng.integers(1, 40)), bool(rng.random() < 0.5)
                for scheduler in pair:
                    scheduler.add_request(make_request(f"r{next_id}", prompt.copy(), max_tokens, ignore_eos))
                next_id += 1
        if rng.random() < 0.05 and pair[0].requests:  # an abort
            victim = sorted(pair[0].requests)[int(rng.integers(len(pair[0].requests)))]
            for scheduler in pair:
                scheduler.abort_requests([victim])
        outs = [scheduler.schedule() for scheduler in pair]
        counts_when_scheduled.append((outs[0], dict(outs[0].num_scheduled_tokens)))
        assert summary(outs[0]) == summary(outs[1]), f"step {step}"
        assert held_state(pair[0]) == held_state(pair[1]), f"step {step}"
        assert_tracked_counts_true(pair[0].kv_cache_manager)
        tokens = np.where(rng.random(64) < 0.1, EOS, rng.integers(8, 1000, size=64))
        for side in range(2):
            if not outs[side].is_empty:
                step_tokens = dict(zip(outs[side].num_scheduled_tokens, tokens.tolist()))
                in_flight[side].append((outs[side], workers[side].execute(outs[side], step_tokens)))
        depth = 2 if async_scheduling else 1
        while in_flight[0] and (len(in_flight[0]) >= depth or step == 159):
            results = [pair[side].update_from_output(*in_flight[side][0][:1], *in_flight[side][0][1])
                       for side in range(2)]
            del in_flight[0][0], in_flight[1][0]
            assert results[0].req_ids == results[1].req_ids
            assert [(f.request_id, f.finish_reason) for f in results[0].finished] == \
                   [(f.request_id, f.finish_reason) for f in results[1].finished]
            assert np.array_equal(results[0].new_token_ids, results[1].new_token_ids)
    # A step's counts stay what they were (a decode step's dict may be kept for the next steps).
    assert all(out.num_scheduled_tokens == counts for out, counts in counts_when_scheduled)
    assert pair[0].at_once_steps > 20, "the array path never ran"
    assert pair[1].at_once_steps == 0
    assert pair[0].lookups > 20 or not caching
    if num_blocks == 70:
        assert pair[0].num_preemptions > 0 and pair[0].num_preemptions == pair[1].num_preemptions
