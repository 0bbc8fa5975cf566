from __future__ import annotations

import hashlib

import numpy as np

from vllm_lite.core.kv_cache_manager import UNSALTED_ROOT_KEY, KVCacheManager, block_key, root_block_key
from vllm_lite.core.request import Request
from vllm_lite.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, np.array(tokens, dtype=np.int32), SamplingParams(), (0,), max_tokens=16)


def admit(manager: KVCacheManager, request: Request):
    hits, num_computed = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, hits)
    manager.record_admission(request, num_computed)
    request.num_computed_tokens = request.num_tokens
    return hits, num_computed, new


def test_prefix_hit_over_full_blocks_only() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    admit(manager, first)
    second = make_request("b", list(range(8)) + [99, 98, 97])
    hits, num_computed, _ = admit(manager, second)
    assert num_computed == 8 and [b.block_id for b in hits] == manager.get_block_ids("a")[:2]
    assert manager.stats.hits == 8


def test_longest_hit_leaves_the_last_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    admit(manager, make_request("a", list(range(8))))
    _, num_computed, _ = admit(manager, make_request("b", list(range(8))))
    assert num_computed == 4  # 8 tokens cached, but at most num_tokens - 1 = 7 may hit


def test_hash_chain_distinguishes_equal_blocks_after_different_prefixes() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=2, enable_caching=True)
    admit(manager, make_request("a", [1, 2, 3, 4, 5]))
    _, num_computed, _ = admit(manager, make_request("b", [9, 9, 3, 4, 5]))
    assert num_computed == 0


def test_free_returns_blocks_and_keeps_them_cached() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    request = make_request("a", list(range(9)))
    admit(manager, request)
    assert manager.get_num_free_blocks() == 9 - 3
    manager.free(request)
    assert manager.get_num_free_blocks() == 9
    _, num_computed, _ = admit(manager, make_request("b", list(range(9))))
    assert num_computed == 8


def test_allocation_failure_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    request = make_request("a", list(range(20)))
    assert manager.allocate_slots(request, 20) is None
    assert manager.get_num_free_blocks() == 3 and "a" not in manager.req_to_blocks


def make_salted_request(request_id: str, tokens: list[int], cache_salt: str | None) -> Request:
    return Request(request_id, np.array(tokens, dtype=np.int32), SamplingParams(), (0,), max_tokens=16,
                   cache_salt=cache_salt)


def test_block_keys_are_sha256_of_parent_and_tokens() -> None:
    # Finding 13: keys were Python's 64-bit hash() of (parent, bytes); now each is a 32-byte SHA-256
    # digest over the 32-byte parent key and the block's int32 tokens.
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    request = make_request("a", list(range(9)))
    admit(manager, request)
    first = hashlib.sha256(bytes(32) + np.arange(4, dtype=np.int32).tobytes()).digest()
    second = hashlib.sha256(first + np.arange(4, 8, dtype=np.int32).tobytes()).digest()
    assert request.block_hashes == [first, second]


def test_colliding_blocks_of_the_old_scheme_get_different_keys() -> None:
    # hash() of a small int is the int itself and hash(-1) == hash(-2) in CPython, so the old
    # key hash((parent, tokens)) was forgeable in principle; bytes that differ in one token must
    # now give different keys and no prefix hit.
    manager = KVCacheManager(num_blocks=20, block_size=2, enable_caching=True)
    admit(manager, make_request("a", [1, 2, 3]))
    other = make_request("b", [1, 3, 3])
    _, num_computed, _ = admit(manager, other)
    assert num_computed == 0
    assert len({block_key(UNSALTED_ROOT_KEY, bytes(8)), block_key(UNSALTED_ROOT_KEY, bytes(7) + b"\x01")}) == 2


def test_cache_salt_separates_prefix_caches() -> None:
    manager = KVCacheManager(num_blocks=30, block_size=4, enable_caching=True)
    tokens = list(range(9))
    admit(manager, make_salted_request("salted", tokens, "tenant-a"))
    assert admit(manager, make_salted_request("unsalted", tokens, None))[1] == 0
    assert admit(manager, make_salted_request("other-salt", tokens, "tenant-b"))[1] == 0
    assert admit(manager, make_salted_request("same-salt", tokens, "tenant-a"))[1] == 8
    assert root_block_key("tenant-a") != UNSALTED_ROOT_KEY


def test_sliding_window_frees_blocks_outside_the_window() -> None:
    """Window 8, blocks of 4: after computing 40 tokens the next query (position 40) sees keys
    33..40, so blocks 0-7 (tokens 0..31) are freed and read as the null block 0."""
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True, sliding_window=8)
    request = make_request("a", list(range(40)))
    admit(manager, request)
    assert manager.get_num_free_blocks() == 19 - 10
    request.append_token(7)
    manager.allocate_slots(request, 1)
    block_ids = manager.get_block_ids("a")
    assert block_ids[:8] == [0] * 8 and 0 not in block_ids[8:]
    assert manager.get_num_free_blocks() == 19 - 3
    manager.free(request)
    assert manager.get_num_free_blocks() == 19


def test_no_freeing_without_a_window() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    request = make_request("a", list(range(40)))
    admit(manager, request)
    manager.allocate_slots(request, 1)
    assert 0 not in manager.get_block_ids("a") and manager.get_num_free_blocks() == 19 - 11


def test_sliding_window_takes_only_the_prefix_hits_it_can_see() -> None:
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True, sliding_window=8)
    first = make_request("a", list(range(40)))
    admit(manager, first)
    manager.free(first)
    second = make_request("b", list(range(40)) + [99])
    _, num_computed, _ = admit(manager, second)
    # 40 cached tokens hit; the query at 40 sees 33..40: blocks 8 and 9 are held, 0-7 are not.
    assert num_computed == 40
    assert manager.get_block_ids("b")[:8] == [0] * 8
    assert manager.get_num_free_blocks() == 19 - 3
    assert manager.max_blocks_needed(1000, max_chunk=12) == 6  # ceil((7 + 12) / 4) + 1
