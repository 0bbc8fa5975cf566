"""GGUF weights kept quantized (`quantization="gguf"`, implied by a .gguf model): linear layers and
the embedding hold their GGUF tensors as raw blocks (uint8 `[rows, row_bytes]`) instead of fp32.

Block formats (llama.cpp's, 32 weights a block along the input dimension): Q8_0 = fp16 scale d +
32 int8 (w = d * q, 34 bytes); Q4_1 = fp16 scale d + fp16 min m + 16 bytes of nibbles (low nibbles
are weights 0-15, high nibbles 16-31; w = d * q + m, 20 bytes). Other GGUF types (fp32/fp16 norms,
any other quantization) are dequantized to the model dtype at load as before.

Compute: decode-sized batches (up to `GEMM_MAX_ROWS` rows) go through the csrc kernel, which widens
each block to fp32 in registers and accumulates in fp32; larger batches (prefill) dequantize the
weight once and run a matmul in the activations' dtype (bf16 or float32). Activations keep the
model dtype (`dtype`) outside the layer.
Without the csrc build, blocks are widened with torch ops (`dequantize_torch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import _custom_ops as ops

BLOCK_SIZE = 32
GGML_TYPE_Q4_1 = 3
GGML_TYPE_Q8_0 = 8
BLOCK_BYTES: Mapping[int, int] = {GGML_TYPE_Q4_1: 20, GGML_TYPE_Q8_0: 34}
KEPT_TYPE_NAMES: Mapping[int, str] = {GGML_TYPE_Q4_1: "Q4_1", GGML_TYPE_Q8_0: "Q8_0"}
# Above this many rows the weight is dequantized once per call and multiplied by a matmul: the
# kernel re-reads the weight for every 4 rows.
GEMM_MAX_ROWS = 8


@dataclass(frozen=True, slots=True)
class GGUFWeight:
    """A linear weight in a GGUF block format: `qweight` uint8 `[out_features, row_bytes]`."""

    qweight: torch.Tensor
    qtype: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]


def row_bytes(qtype: int, in_features: int) -> int:
    return in_features // BLOCK_SIZE * BLOCK_BYTES[qtype]


def can_keep(qtype: int, in_features: int) -> bool:
    """Whether a tensor of this GGUF type and row length can stay in its block format."""
    return qtype in BLOCK_BYTES and in_features % BLOCK_SIZE == 0


def gguf_weight_of(param: torch.Tensor) -> GGUFWeight | None:
    """The GGUFWeight a parameter made by `make_quantized_param` holds, else None."""
    qtype = getattr(param, "gguf_qtype", None)
    if qtype is None:
        return None
    return GGUFWeight(param.data, qtype, param.gguf_in_features)


def make_quantized_param(like: nn.Parameter, qtype: int) -> nn.Parameter:
    """An empty uint8 parameter for `like`'s `[out, in]` weight in `qtype` blocks; it keeps the
    weight loader, so fused (q/k/v, gate/up) and tied loading work on whole block rows."""
    out_features, in_features = like.shape
    param = nn.Parameter(torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8),
                         requires_grad=False)
    param.gguf_qtype = qtype
    param.gguf_in_features = in_features
    if hasattr(like, "weight_loader"):
        param.weight_loader = like.weight_loader
    return param


def keep_quantized(model: nn.Module, qtypes: Mapping[str, int]) -> None:
    """Replace the float weights named in `qtypes` (parameter name -> GGUF type) by uint8 block
    parameters before loading. A parameter shared by several modules (tied embedding and LM head)
    is replaced everywhere it appears."""
    params = dict(model.named_parameters(remove_duplicate=False))
    replaced: dict[int, nn.Parameter] = {}
    for name, qtype in qtypes.items():
        old = params[name]
        if id(old) not in replaced:
            replaced[id(old)] = make_quantized_param(old, qtype)
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if id(param) in replaced:
                setattr(module, attr, replaced[id(param)])


def dequantize_torch(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 `[rows, in_features]` from uint8 blocks `[rows, row_bytes]`, with torch ops."""
    rows = qweight.shape[0]
    blocks = qweight.reshape(rows, -1, BLOCK_BYTES[qtype])
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == GGML_TYPE_Q8_0:
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * scale
    else:
        minimum = blocks[..., 2:4].contiguous().view(torch.float16).float()
        nibbles = blocks[..., 4:].to(torch.int32)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
        values = q * scale + minimum
    return values.reshape(rows, -1)


def dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    if ops.is_available():
        return ops.gguf_dequantize(qweight.contiguous(), qtype)
    return dequantize_torch(qweight, qtype)


def gguf_linear(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` in x's dtype: fp32 inside for decode-sized batches (the kernel) and
    float32 inputs; a larger bf16 batch multiplies by the weight dequantized to bf16, as a bf16
    model's weights are (3.5-4.7x faster than fp32 at 300-4,800 rows, `[1536, 576]`)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= GEMM_MAX_ROWS and ops.is_available():
        out = ops.gguf_gemm(flat.float().contiguous(), weight.qweight, weight.qtype)
    elif flat.dtype == torch.bfloat16:
        out = F.linear(flat, dequantize(weight.qweight, weight.qtype).to(torch.bfloat16))
    else:
        out = F.linear(flat.float(), dequantize(weight.qweight, weight.qtype))
    out = out.to(x.dtype)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.out_features)


def gguf_embedding(input_ids: torch.Tensor, weight: GGUFWeight, dtype: torch.dtype) -> torch.Tensor:
    """The rows of a block-format embedding table for `input_ids`, widened to `dtype`."""
    rows = weight.qweight.index_select(0, input_ids.reshape(-1))
    return dequantize(rows, weight.qtype).to(dtype).view(*input_ids.shape, weight.in_features)

