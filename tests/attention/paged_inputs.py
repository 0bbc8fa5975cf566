"""Random paged-attention batches for backend and kernel tests (shared by tests/attention)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.attention.backend import CommonAttentionMetadata


# Batches that exercise a backend's routing: decode rows and short prefill rows to the native
# decode op, long prefill rows to SDPA.
BACKEND_SPECS = {
    "mixed": [(0, 5), (13, 1), (20, 7), (3, 1), (0, 1), (9, 2)],
    "decode": [(40, 1), (7, 1), (0, 1)],
    "prefill": [(0, 17), (16, 4)],  # with a prefix-cache hit
    # Beyond the native backend's PER_TOKEN_PREFILL_MAX_KEYS (256): SDPA rows beside per-token ones.
    "long prefill": [(0, 300), (6, 1), (250, 9), (10, 20), (0, 256)],
}


# Where Triton kernels run in these tests: the CPU under the interpreter (the CI default, set by
# conftest), else the GPU, compiled.
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D], strided view into a fused qkv tensor like the model's
    value: torch.Tensor
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, Hkv, D], context already cached
    common: CommonAttentionMetadata
    scale: float


def make_paged_batch(specs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, seed: int = 0, num_padded: int = 0,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> PagedBatch:
    """`specs`: one (context_len, query_len) per sequence; context_len > 0 is a prefix-cache hit
    (its keys are already in the cache), query_len 1 with context a decode. Blocks are drawn at
    random (block 0 stays the null block); every cache entry starts as random noise, so reading
    a wrong slot shows. `num_padded` appends CUDA-graph style padding: sequences with one token,
    seq_len 0 and slot -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in specs]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    num_seqs = len(specs) + num_padded
    max_blocks = max(blocks_per_seq) + 1
    block_table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    slots, query_lens, seq_lens = [], [], []
    for i, ((context, query_len), nb) in enumerate(zip(specs, blocks_per_seq)):
        block_table[i, :nb] = [perm.pop() for _ in range(nb)]
        pos = np.arange(context, context + query_len)
        slots.append(block_table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        query_lens.append(query_len)
        seq_lens.append(context + query_len)
    for _ in range(num_padded):
        slots.append(np.array([-1], dtype=np.int64))
        query_lens.append(1)
        seq_lens.append(0)
    slot_mapping = np.concatenate(slots)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(query_lens)
    seq_lens_np = np.array(seq_lens, dtype=np.int32)
    num_tokens = int(query_start_loc[-1])
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens_np).to(device),
        block_table=torch.from_numpy(block_table).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc_np=query_start_loc,
        seq_lens_np=seq_lens_np,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        block_size=block_size,
    )
    return PagedBatch(
        query=q.reshape(num_tokens, num_q_heads, head_dim).contiguous(),
        key=k.view(num_tokens, num_kv_heads, head_dim),
        value=v.view(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache, common=common, scale=head_dim ** -0.5,
    )


def reference_forward(batch: PagedBatch, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the write) from the torch reference backend, on a copy of the cache.
    Padded tokens (slot -1) are dropped first: the reference does not take them."""
    from vllm_lite.attention.torch_backend import TorchAttentionBackend

    common = batch.common
    real = int((common.seq_lens_np > 0).sum())
    n = int(common.query_start_loc_np[real])
    trimmed = CommonAttentionMetadata(
        query_start_loc=common.query_start_loc[: real + 1], seq_lens=common.seq_lens[:real],
        block_table=common.block_table[:real], slot_mapping=common.slot_mapping[:n],
        query_start_loc_np=common.query_start_loc_np[: real + 1], seq_lens_np=common.seq_lens_np[:real],
        num_actual_tokens=n, max_query_len=common.max_query_len,
        block_size=common.block_size,
    )
    backend = TorchAttentionBackend()
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query[:n], batch.key[:n], batch.value[:n], cache,
                          backend.build(trimmed), batch.scale, sliding_window, logits_soft_cap, alibi_slopes, sinks)
    return out, cache
