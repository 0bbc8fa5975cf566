"""Prefix-cache registration of running requests (`KVCacheManager._register_running`, which
`allocate_running` calls for the requests whose blocks filled up): csrc's loop (vllm_lite.
_bookkeeping's `register_blocks`) against `_register_full_blocks` request by request, on random
requests sharing blocks of tokens (an identical block cached already stays private), salted and
not, holding the null block, several keys at once or none: the same keys, the same blocks in
the pool's map, the same counters."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_fakes import NEEDS_NATIVE_LOOPS
from vllm_lite.core.kv_cache_manager import KVCacheManager, block_key, root_block_key
from vllm_lite.core.request import Request
from vllm_lite.sampling_params import SamplingParams

pytestmark = NEEDS_NATIVE_LOOPS

BLOCK_SIZE = 4


def twin_requests(rng: np.random.Generator, count: int) -> tuple[list[Request], list[Request]]:
    """The same requests twice (each manager changes its own): tokens from a small vocabulary
    in a few shared patterns, so that equal blocks (and equal keys) recur."""
    patterns = [rng.integers(0, 3, 40).astype(np.int32) for _ in range(3)]
    specs = []
    for i in range(count):
        tokens = patterns[int(rng.integers(3))].copy()
        if rng.random() < 0.5:
            tokens[int(rng.integers(8, 40)):] = rng.integers(0, 3, 1)[0]
        salt = None if rng.random() < 0.7 else f"salt{int(rng.integers(2))}"
        specs.append((f"r{i}", tokens, salt))
    make = lambda: [Request(rid, tokens, SamplingParams(max_tokens=4), (), 4, cache_salt=salt)
                    for rid, tokens, salt in specs]
    return make(), make()


def holding_blocks(manager: KVCacheManager, requests: list[Request], rng: np.random.Generator) -> None:
    null = manager.block_pool.null_block
    for request in requests:
        blocks = manager.block_pool.allocate(10)
        if rng.random() < 0.2:  # (a block freed outside a sliding window: never entered)
            blocks[0] = null
        manager.req_to_blocks[request.request_id] = blocks
        manager.num_cached_blocks[request.request_id] = 0


def state_of(manager: KVCacheManager, requests: list[Request]) -> tuple:
    pool = manager.block_pool
    return ([request.block_hashes for request in requests], dict(manager.num_cached_blocks),
            {key: block.block_id for key, block in pool.cached_blocks.items()},
            [block.block_hash for block in pool.blocks], pool.cache_version)


@pytest.mark.parametrize("seed", range(6))
def test_c_registration_matches_the_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ours, theirs = (KVCacheManager(200, BLOCK_SIZE, enable_caching=True, native=native) for native in (True, False))
    our_requests, their_requests = twin_requests(rng, 12)
    holding_blocks(ours, our_requests, np.random.default_rng(seed))
    holding_blocks(theirs, their_requests, np.random.default_rng(seed))
    full = np.zeros(len(our_requests), dtype=np.int64)
    for _ in range(6):  # blocks fill up step after step: one key at a time, several, or none
        full = np.minimum(full + rng.integers(0, 4, len(full)), 10)
        known = np.minimum(full * BLOCK_SIZE + rng.integers(0, 2 * BLOCK_SIZE, len(full)), 40)
        registering = np.flatnonzero(rng.random(len(full)) < 0.8)
        for manager, requests in ((ours, our_requests), (theirs, their_requests)):
            manager._register_running(registering, requests, full, known)
        assert state_of(ours, our_requests) == state_of(theirs, their_requests)
    assert ours.block_pool.cache_version > 0


def test_keys_chain_from_the_salted_root() -> None:
    manager = KVCacheManager(20, BLOCK_SIZE, enable_caching=True, native=True)
    tokens = np.arange(12, dtype=np.int32)
    request = Request("a", tokens, SamplingParams(max_tokens=4), (), 4, cache_salt="s")
    manager.req_to_blocks["a"] = manager.block_pool.allocate(3)
    manager.num_cached_blocks["a"] = 0
    manager._register_running(np.array([0]), [request], np.array([2]), np.array([12]))
    first = block_key(root_block_key("s"), tokens[:4].tobytes())
    assert request.block_hashes == [first, block_key(first, tokens[4:8].tobytes()),
                                    block_key(request.block_hashes[1], tokens[8:12].tobytes())]
    assert manager.num_cached_blocks["a"] == 2  # (the third block is keyed, not entered: not asked)
    assert [manager.block_pool.cached_blocks[key] for key in request.block_hashes[:2]] == manager.req_to_blocks["a"][:2]


def test_c_registration_names_what_it_cannot_find() -> None:
    manager = KVCacheManager(20, BLOCK_SIZE, enable_caching=True, native=True)
    request = Request("a", np.arange(8, dtype=np.int32), SamplingParams(max_tokens=4), (), 4)
    with pytest.raises(KeyError, match="'a'"):  # holds no blocks
        manager._register_running(np.array([0]), [request], np.array([1]), np.array([8]))
    manager.req_to_blocks["a"] = manager.block_pool.allocate(4)
    manager.num_cached_blocks["a"] = 0
    with pytest.raises(IndexError, match="16 tokens known"):
        manager._register_running(np.array([0]), [request], np.array([4]), np.array([16]))
