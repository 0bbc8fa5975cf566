"""Tokens that attend past their own position (the metadata's `key_ends_np`: Gemma 3's image
placeholders see each other both ways) on every attention backend, against attention written out
key by key: each token attends keys [max(0, p - W + 1), key_end), with and without a sliding
window W, beside causal rows, decodes, a prefix-cache hit and a long row (SDPA on cpu_native)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from paged_inputs import TRITON_DEVICE, make_paged_batch

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.torch_backend import TorchAttentionBackend

# (context_len, query_len) per sequence, and the image spans [start, end) in its positions
SPECS = [(0, 12), (5, 1), (8, 10), (0, 3), (0, 300)]
SPANS = {0: [(2, 8)], 2: [(7, 12), (14, 17)], 4: [(100, 104), (290, 299)]}


def _with_key_ends(batch, specs: list[tuple[int, int]]) -> None:
    common = batch.common
    key_ends = []
    for row, (context, query_len) in enumerate(specs):
        ends = np.arange(context, context + query_len) + 1
        for start, end in SPANS.get(row, ()):
            inside = (ends - 1 >= start) & (ends - 1 < end)
            ends[inside] = end
        key_ends.append(ends)
    common.key_ends_np = np.concatenate(key_ends).astype(np.int32)


def _written_out(batch, specs: list[tuple[int, int]], cache: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Attention of each token over its sequence's cached keys in float64, key by key."""
    common, bs = batch.common, batch.common.block_size
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    group = batch.query.shape[1] // cache.shape[3]
    token = 0
    for row, (context, query_len) in enumerate(specs):
        positions = np.arange(context + query_len)
        blocks = common.block_table[row].cpu().numpy()[positions // bs]
        keys = cache[blocks, 0, positions % bs].double().cpu().repeat_interleave(group, dim=1)
        values = cache[blocks, 1, positions % bs].double().cpu().repeat_interleave(group, dim=1)
        for p in range(context, context + query_len):
            end = int(common.key_ends_np[token])
            low = max(0, p - sliding_window + 1) if sliding_window else 0
            scores = torch.einsum("hd,khd->hk", batch.query[token].double().cpu(), keys[low:end]) * batch.scale
            out[token] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[low:end])
            token += 1
    return out


def _backends() -> list:
    backends = [TorchAttentionBackend()]
    if cpu_native.is_available():
        from vllm_lite.attention.cpu_native_backend import CpuNativeAttentionBackend

        backends.append(CpuNativeAttentionBackend())
    return backends


@pytest.mark.parametrize("sliding_window", [None, 3])
@pytest.mark.parametrize("backend", _backends(), ids=lambda backend: backend.name)
def test_tokens_attend_up_to_their_key_ends(backend, sliding_window: int | None) -> None:
    batch = make_paged_batch(SPECS, 4, 2, 16, block_size=8, seed=3)
    _with_key_ends(batch, SPECS)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale,
                          sliding_window)
    assert (out.double() - _written_out(batch, SPECS, cache, sliding_window)).abs().max() <= 1e-5


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_the_triton_backend_attends_those_rows_again() -> None:
    pytest.importorskip("triton")
    from vllm_lite.attention.triton_backend import TritonAttentionBackend

    specs = SPECS[:4]  # (the long row would take the interpreter minutes)
    batch = make_paged_batch(specs, 4, 2, 16, block_size=8, seed=3, device=TRITON_DEVICE)
    _with_key_ends(batch, specs)
    backend = TritonAttentionBackend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, backend.build(batch.common), batch.scale)
    assert (out.double().cpu() - _written_out(batch, specs, cache, None)).abs().max() <= 1e-5
