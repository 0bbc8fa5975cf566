"""The int8_per_token_head KV cache format (vLLM's name and rule), torch reference.

Each (token, KV head) row of K or V is stored as `head_dim` int8 codes followed by its fp32 scale
in 4 bytes: the cache is an int8 tensor `[num_blocks, 2, block_size, num_kv_heads, head_dim + 4]`,
so one block still holds all of a token's K and V together and nothing else changes shape.

    scale = max(max(|x|) / 127, 1e-6)     (fp32, per row)
    code  = trunc(clamp(x * (1 / scale) ± 0.5, -128, 127))   (round half away from zero)
    x'    = code * scale

The csrc write (reshape_and_cache_int8) follows the same arithmetic, so a row it writes equals
the one written here bit for bit. Decode rounds each query head by the same rule
(torch_backend.decode_attention, csrc paged_attention_decode_int8).
"""

from __future__ import annotations

import torch

from vllm_lite.config import KV_SCALE_BYTES

MIN_SCALE = 1e-6  # an all-zero row keeps a usable scale (vLLM's floor)


def is_int8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float rows -> [..., D + 4] int8: the codes, then the scale's bytes."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(MIN_SCALE)
    scaled = x * (1.0 / scale)
    codes = torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5).clamp(-128, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows (any strides) -> [..., D] in `dtype`."""
    codes, scale_bytes = rows[..., :-KV_SCALE_BYTES], rows[..., -KV_SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.float32)  # [..., 1]
    return (codes.float() * scale).to(dtype)
