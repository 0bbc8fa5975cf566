"""bf16 linear layers on AMX tiles, for the small row counts of decode (csrc/bf16_linear_ops.cpp).

oneDNN's packed matmul runs AMX too, but at decode sizes a call spends tens of microseconds
before any work and streams the weights at 5-20 GB/s. Up to `AMX_MAX_ROWS` rows the csrc op
runs instead: the weight in whole AMX B tiles, x copied into whole A tiles per call, fp32 sums
rounded to bf16 once. Above it (prefill) oneDNN's blocked kernels stay faster. Both read one copy of
the weight: oneDNN's bf16 layout on AMX CPUs is the tile layout (checked byte for byte at load; a
oneDNN that packs otherwise gets a copy of its own).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

BLOCK = 32  # the tile's K values per row and the packed block's columns (two 16-column tiles)
AMX_MAX_ROWS = 64


def pack_b_tiles(weight: torch.Tensor, per_lane: int) -> torch.Tensor:
    """`weight [N, K]` zero-padded to multiples of 32 rows and 16 x `per_lane` columns and laid out
    as `[N/32][K/(16 per_lane)][16 K groups][32 columns][per_lane]`: AMX B tiles, each tile row 16
    columns x `per_lane` consecutive K values (2 for bf16, 4 for int8), the two tiles of a
    32-column block side by side, one column block's K steps following each other."""
    rows, cols = weight.shape
    block_k = 16 * per_lane
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // block_k) * block_k, dtype=weight.dtype)
    padded[:rows, :cols] = weight
    n_blocks, k_blocks = padded.shape[0] // BLOCK, padded.shape[1] // block_k
    blocks = padded.view(n_blocks, BLOCK, k_blocks, 16, per_lane).permute(0, 2, 3, 1, 4)
    return blocks.contiguous().view(-1)


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight's B tiles (`pack_b_tiles`, K in pairs): oneDNN's AB16b32a2b."""
    return pack_b_tiles(weight.to(torch.bfloat16), 2)


def onednn_buffer(packed: torch.Tensor) -> torch.Tensor:
    """The bytes of oneDNN's packed (opaque) tensor as a bf16 tensor over the same memory; it is
    valid while `packed` lives."""
    num_bytes = torch.ops.mkldnn._nbytes(packed)
    memory = (ctypes.c_uint8 * num_bytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    return torch.frombuffer(memory, dtype=torch.bfloat16)


@dataclass(frozen=True, slots=True)
class AmxWeight:
    """A bf16 weight in AMX tiles (`tiles`) and in oneDNN's blocked layout (`onednn`, for more
    than `AMX_MAX_ROWS` rows); `tiles` is a view of `onednn`'s memory where the layouts agree."""

    tiles: torch.Tensor
    onednn: torch.Tensor
    out_features: int

    @staticmethod
    def pack(weight: torch.Tensor, onednn: torch.Tensor) -> AmxWeight:
        tiles = pack_tiles(weight.detach())
        shared = onednn_buffer(onednn)
        if shared.numel() == tiles.numel() and torch.equal(shared.view(torch.int16), tiles.view(torch.int16)):
            tiles = shared
        return AmxWeight(tiles, onednn, weight.shape[0])


def amx_linear(x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, W, bias)` on AMX tiles for a bf16 `x` of at most `AMX_MAX_ROWS` rows; None
    when the caller's oneDNN path should run instead."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > AMX_MAX_ROWS or x.dtype != torch.bfloat16:
        return None
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.ops.vllm_lite_C.amx_bf16_linear(flat, weight.tiles, weight.out_features, bias)
    return out.view(*x.shape[:-1], weight.out_features)
