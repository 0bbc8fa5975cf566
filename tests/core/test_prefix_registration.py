"""When a running request's blocks enter the prefix cache: a decode step that only fills blocks
registers nothing; before a prefix lookup the running requests register every block full of
scheduled, known tokens (so a lookup finds what registering each block the step it filled
would have given it), and a request registers the rest when it frees its blocks (finished,
aborted, preempted)."""

from __future__ import annotations

import numpy as np

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.kv_cache_manager import block_key, root_block_key
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.sampling_params import SamplingParams
from scheduler_fakes import FakeWorker, distinct_prompt

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, 256, True), CacheConfig(BLOCK_SIZE, num_blocks, None, True), num_blocks)


def make_request(request_id: str, prompt: np.ndarray, max_tokens: int) -> Request:
    return Request(request_id, np.asarray(prompt, dtype=np.int32), SamplingParams(ignore_eos=True), (7,), max_tokens)


class Steps:
    """Schedules and applies steps at once (sync), each sampled token distinct (so every block's
    key is)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.worker, self.next_token = scheduler, FakeWorker(), 10_000

    def step(self):
        out = self.scheduler.schedule()
        tokens = {req_id: self.next_token + i for i, req_id in enumerate(out.num_scheduled_tokens)}
        self.next_token += len(tokens)
        outputs = self.scheduler.update_from_output(out, *self.worker.execute(out, tokens))
        return out, outputs


def chain_keys(tokens: np.ndarray, num_blocks: int) -> list[bytes]:
    keys, parent = [], root_block_key(None)
    for i in range(num_blocks):
        parent = block_key(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE].tobytes())
        keys.append(parent)
    return keys


def test_decode_blocks_enter_the_cache_when_the_request_ends() -> None:
    scheduler = make_scheduler()
    steps = Steps(scheduler)
    kv = scheduler.kv_cache_manager
    scheduler.add_request(make_request("a", distinct_prompt("a", 6), max_tokens=12))
    steps.step()  # the prompt: its first block enters the cache at admission
    assert kv.num_cached_blocks["a"] == 1
    cached_at_admission = dict(kv.block_pool.cached_blocks)
    for _ in range(8):  # fills blocks 1 and 2 with no lookup in between
        steps.step()
    assert scheduler.requests["a"].num_computed_tokens == 14
    assert kv.block_pool.cached_blocks == cached_at_admission and kv.num_cached_blocks["a"] == 1
    blocks = kv.req_to_blocks["a"]  # (the list itself: it grows to the end)
    while scheduler.requests:
        steps.step()
    # 18 tokens (the prompt, then the samples 10,000 ... 10,011), the last never computed: 17
    # scheduled, 4 full blocks, each under its chained key; the fifth is not full.
    tokens = np.concatenate([distinct_prompt("a", 6), np.arange(10_000, 10_012, dtype=np.int32)])
    assert [block.block_hash for block in blocks[:4]] == chain_keys(tokens, 4)
    assert blocks[4].block_hash is None
    assert {key: block.block_id for key, block in kv.block_pool.cached_blocks.items()} == \
        {block.block_hash: block.block_id for block in blocks[:4]}


def test_a_lookup_finds_the_blocks_a_running_request_filled() -> None:
    """"b"'s prompt is "a"'s first 9 tokens and more: it hits the two blocks "a" filled while
    decoding, in the step "b" is admitted, while "a" still runs."""
    scheduler = make_scheduler()
    steps = Steps(scheduler)
    kv = scheduler.kv_cache_manager
    scheduler.add_request(make_request("a", distinct_prompt("a", 6), max_tokens=20))
    for _ in range(6):  # the prompt, then 5 decode steps: 12 tokens known, 11 computed
        steps.step()
    request = scheduler.requests["a"]
    assert (request.num_tokens, request.num_computed_tokens, kv.num_cached_blocks["a"]) == (12, 11, 1)
    prompt = np.concatenate([request.all_token_ids[:9], distinct_prompt("b", 3)])
    scheduler.add_request(make_request("b", prompt, max_tokens=4))
    out, _ = steps.step()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 8
    assert new.block_ids[:2] == kv.get_block_ids("a")[:2] and "a" in scheduler.requests
    assert kv.num_cached_blocks["a"] == 3  # (and the block it fills in this step: all known, all scheduled)


def test_a_preempted_request_returns_to_the_blocks_it_filled() -> None:
    """Under KV pressure the most recently admitted request ("b") is preempted; the blocks it
    filled while decoding were never looked up, yet they are cached when it is freed (but the
    tail one, which "a" takes), and it comes back with them as prefix hits."""
    scheduler = make_scheduler(num_blocks=9)  # 8 usable blocks of 4 tokens
    steps = Steps(scheduler)
    kv = scheduler.kv_cache_manager
    scheduler.add_request(make_request("a", distinct_prompt("a", 6), max_tokens=14))
    scheduler.add_request(make_request("b", distinct_prompt("b", 6), max_tokens=14))
    preempted_with = None
    for _ in range(40):
        held = [block.block_id for block in kv.req_to_blocks.get("b", ())]
        computed = scheduler.requests["b"].num_computed_tokens
        out, _ = steps.step()
        if "b" in out.preempted_req_ids:
            preempted_with = (computed, held)
            break
    assert preempted_with is not None, "no preemption"
    computed, held = preempted_with
    assert computed == 4 * BLOCK_SIZE == BLOCK_SIZE * len(held)  # every block it held full, three past its prompt's
    assert kv.get_block_ids("a")[-1] == held[-1]  # (the free queue's head: its tail block)
    cached_ids = {block.block_id for block in kv.block_pool.cached_blocks.values()}
    assert set(held[:3]) <= cached_ids
    returned = None
    while scheduler.requests:
        out, _ = steps.step()
        returned = returned or next((new for new in out.scheduled_new_reqs if new.req_id == "b"), None)
    assert returned is not None and returned.num_computed_tokens == 3 * BLOCK_SIZE
    assert returned.block_ids[:3] == held[:3]
