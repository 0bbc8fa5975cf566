"""Write the step's new keys and values into the paged KV cache (Triton).

Cache layout per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]`; token `t` goes to
block `slot_mapping[t] // block_size`, offset `slot_mapping[t] % block_size`. Slot -1 marks a
padded token (CUDA-graph padding) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_blk, stride_c_kv, stride_c_off, stride_c_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = cache_ptr + block * stride_c_blk + offset * stride_c_off + heads * stride_c_h + dims
    key = tl.load(key_ptr + token.to(tl.int64) * stride_k_t + heads * stride_k_h + dims, mask=mask)
    tl.store(dst, key, mask=mask)
    value = tl.load(value_ptr + token.to(tl.int64) * stride_v_t + heads * stride_v_h + dims, mask=mask)
    tl.store(dst + stride_c_kv, value, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key/value `[T, num_kv_heads, head_dim]` (any row/head strides, contiguous last dim),
    slot_mapping int64 `[T]` (-1 = skip) -> written into `kv_cache` in place."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
