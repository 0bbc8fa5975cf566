"""Online int8 quantization of linear layers (`quantization="int8"`): dynamic W8A8 on CPU.

At load, each linear layer's weight becomes int8 with one symmetric scale per output channel
(max |w| / 127). Per step, each token's activations get their own scale (max |x| / 127), the
int8 x int8 product accumulates in int32 (`torch._int_mm`: oneDNN, VNNI dot products where the CPU
has them), and the result is rescaled by token scale x channel scale into the model dtype. The
LM head and the embedding stay in the model dtype (as in vLLM's online fp8), so sampling sees
unquantized logits. Where the csrc extension is built, the activations' quantization and the
rescale are one pass each (`quantize_rows_int8`, `dequantize_int32`) instead of nine torch ops.
Weight-only int8 (`torch._weight_int8pack_mm`) is not offered: on these CPUs it measured slower
than the packed bf16 matmul it would replace (benchmarks/RESULTS.md).

On a CPU with AMX-INT8 the weight is kept packed in AMX tiles instead (one copy) and the int8
product runs on them (csrc/int8_linear_ops.cpp, the same integer sums): torch._int_mm, its weight
not packed ahead, streamed int8 weights at decode sizes at half the rate the bf16 tiles stream
bf16 ones, so int8 decode was no faster than bf16's (benchmarks/RESULTS.md, fifty-fourth session).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_lite import _custom_ops as ops
from vllm_lite.model.layers.amx_linear import BLOCK, pack_b_tiles
from vllm_lite.model.layers.matmul_rows import matmul_bucketed

INT8_MAX = 127.0
# A row of zeros quantizes to zeros with any scale; this keeps its scale finite.
MIN_SCALE = 1e-12


def pack_int8_tiles(q: torch.Tensor) -> torch.Tensor:
    """int8 `q [N, K]` as AMX-INT8 B tiles, `[N/32][K/64][16 k-quads][32 n][4 k]` (`pack_b_tiles`:
    the layout csrc/int8_linear_ops.cpp reads)."""
    return pack_b_tiles(q, 4)


def unpack_int8_tiles(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`pack_int8_tiles`'s input back: int8 [rows, cols]."""
    n_blocks, k_blocks = -(-rows // BLOCK), -(-cols // 64)
    blocks = tiles.view(n_blocks, k_blocks, 16, BLOCK, 4).permute(0, 3, 1, 2, 4)
    return blocks.reshape(n_blocks * BLOCK, k_blocks * 64)[:rows, :cols]


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """An int8 weight with one float32 scale per output row (`scale [out]`), in the form this
    CPU's int8 matmul takes: AMX tiles (`tiles`, `pack_int8_tiles`) where the CPU has AMX-INT8,
    else `qweight_t [in, out]` for torch._int_mm (a transposed view of a contiguous [out, in]).
    One of the two, never both (one copy of the weight)."""

    qweight_t: torch.Tensor | None
    scale: torch.Tensor
    tiles: torch.Tensor | None = None
    in_features: int = 0

    @staticmethod
    def of(q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
        """int8 values `q [out, in]` and their row scales, for this CPU's int8 matmul."""
        if q.device.type == "cpu" and ops.amx_int8_usable():
            return Int8Weight(None, scale, pack_int8_tiles(q), q.shape[1])
        return Int8Weight(q.contiguous().t(), scale, None, q.shape[1])

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)
        return Int8Weight.of(torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale)

    def values(self) -> torch.Tensor:
        """The int8 values [out, in]."""
        if self.tiles is not None:
            return unpack_int8_tiles(self.tiles, self.scale.shape[0], self.in_features)
        return self.qweight_t.t()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (int8 [M, K], float32 scales [M, 1]). The torch form of the csrc
    op `quantize_rows_int8` (same rule, same result)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / INT8_MAX).clamp_min(MIN_SCALE)
    return torch.round(x / scale).to(torch.int8), scale


def dequantize_rows(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                    bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int32 `acc [M, N]` -> `acc * row_scale * col_scale (+ bias)` in `dtype`. The torch form of
    the csrc op `dequantize_int32`."""
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    torch.mul(acc * row_scale, col_scale, out=out)
    if bias is not None:
        out += bias
    return out


def int8_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    fused_ends = ops.takes_layer_ops(flat)
    if weight.tiles is not None and fused_ends:
        out = ops.amx_int8_linear(flat, weight.tiles, weight.scale, bias)
        return out.view(*x.shape[:-1], out.shape[-1])
    quantize, dequantize = (ops.quantize_rows_int8, ops.dequantize_int32) if fused_ends else (quantize_rows,
                                                                                              dequantize_rows)
    xq, x_scale = quantize(flat)
    if weight.tiles is not None:  # int32 [M, out]
        acc = ops.amx_int8_mm(xq, weight.tiles, weight.scale.shape[0])
    else:
        acc = matmul_bucketed(xq, lambda rows: torch._int_mm(rows, weight.qweight_t))
    out = dequantize(acc, x_scale, weight.scale, bias, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def quantize_model(model: nn.Module, method: str) -> None:
    """Quantize every linear layer of `model` in place (before CPU weight packing)."""
    if method != "int8":
        raise ValueError(f"quantization={method!r} is not supported (supported: 'int8')")
    for module in model.modules():
        if hasattr(module, "quantize_int8"):
            module.quantize_int8()
