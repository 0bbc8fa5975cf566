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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_lite import _custom_ops as ops
from vllm_lite.model.layers.matmul_rows import matmul_bucketed

INT8_MAX = 127.0
# A row of zeros quantizes to zeros with any scale; this keeps its scale finite.
MIN_SCALE = 1e-12


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """An int8 weight ready for `torch._int_mm`: `qweight_t` is `[in, out]` (a transposed view of
    a contiguous `[out, in]` tensor), `scale` float32 `[out]`."""

    qweight_t: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(MIN_SCALE)
        q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return Int8Weight(q.t(), scale)


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
    if ops.takes_layer_ops(flat):
        quantize, dequantize = ops.quantize_rows_int8, ops.dequantize_int32
    else:
        quantize, dequantize = quantize_rows, dequantize_rows
    xq, x_scale = quantize(flat)
    acc = matmul_bucketed(xq, lambda rows: torch._int_mm(rows, weight.qweight_t))  # int32 [M, out]
    out = dequantize(acc, x_scale, weight.scale, bias, x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def quantize_model(model: nn.Module, method: str) -> None:
    """Quantize every linear layer of `model` in place (before CPU weight packing)."""
    if method != "int8":
        raise ValueError(f"quantization={method!r} is not supported (supported: 'int8')")
    for module in model.modules():
        if hasattr(module, "quantize_int8"):
            module.quantize_int8()
