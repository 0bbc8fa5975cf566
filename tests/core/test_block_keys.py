"""Prefix-cache keys from csrc's SHA-256 (vllm_lite._bookkeeping's `block_keys`, in the CPU's SHA
instructions) against hashlib's chain (`kv_cache_manager.block_key`): every block size the
engine allows and some it does not, one key or several, tokens of any int32 value; the managers
of both make the same keys for the same requests; bad arguments are named."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from vllm_lite.bookkeeping import native_loops
from vllm_lite.core.kv_cache_manager import KVCacheManager, block_keys
from vllm_lite.core.request import Request
from vllm_lite.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native_loops is None or not native_loops.sha256_extensions(),
                                reason="vllm_lite._bookkeeping is not built or the CPU has no SHA extensions")


def hashlib_chain(parent: bytes, tokens: np.ndarray, start: int, count: int, block_size: int) -> list[bytes]:
    keys = []
    for i in range(count):
        block = tokens[start + i * block_size:start + (i + 1) * block_size]
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        keys.append(parent)
    return keys


@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 8, 13, 16, 31, 32, 64, 128, 256, 512])
def test_c_keys_are_hashlibs(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    for _ in range(5):
        count = int(rng.integers(0, 6))
        start = int(rng.integers(0, 20))
        tokens = rng.integers(-2**31, 2**31, start + count * block_size + int(rng.integers(0, 3)),
                              dtype=np.int64).astype(np.int32)
        parent = rng.bytes(32)
        assert native_loops.block_keys(parent, tokens, start, count, block_size) == \
            hashlib_chain(parent, tokens, start, count, block_size)


def test_managers_make_the_same_keys() -> None:
    rng = np.random.default_rng(0)
    managers = [KVCacheManager(100, 16, enable_caching=True, native=native) for native in (True, False)]
    assert managers[0]._native is native_loops and managers[1]._native is None
    for i in range(20):
        tokens = rng.integers(0, 5, int(rng.integers(1, 90))).astype(np.int32)
        salt = None if i % 3 else f"salt{i % 2}"
        keys = []
        for manager in managers:
            request = Request(f"r{i}", tokens, SamplingParams(max_tokens=4), (), 4, cache_salt=salt)
            manager._update_block_hashes(request)
            keys.append(request.block_hashes)
        assert keys[0] == keys[1] and len(keys[0]) == len(tokens) // 16


def test_bad_arguments_are_named() -> None:
    tokens = np.arange(16, dtype=np.int32)
    with pytest.raises(ValueError, match="32-byte parent and 3 blocks of 8 tokens from 0 within 16"):
        native_loops.block_keys(bytes(32), tokens, 0, 3, 8)
    with pytest.raises(ValueError, match="parent of 31 bytes"):
        native_loops.block_keys(bytes(31), tokens, 0, 1, 8)
    with pytest.raises(TypeError, match="token_ids"):
        native_loops.block_keys(bytes(32), tokens.astype(np.int64), 0, 1, 8)
    assert block_keys(bytes(32), tokens, 8, 1, 8, native_loops) == hashlib_chain(bytes(32), tokens, 8, 1, 8)
