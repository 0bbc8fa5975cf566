from __future__ import annotations

import torch
from torch import nn

from vllm_lite import _custom_ops as ops


class RMSNorm(nn.Module):
    """`forward(x)` -> normalized x; `forward(x, residual)` -> (normalized x + residual, x +
    residual), vLLM's fused form: the decoder layer carries the residual stream beside the
    hidden states, so the add and the norm are one pass (the csrc op, in place, on CPU).

    The torch path computes in float32 and casts back before the weight multiply, as Hugging
    Face does; the csrc op multiplies by the weight in float32 and rounds once (the same in
    float32, at most one bf16 rounding apart in bfloat16)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._native(x, residual):
            if residual is None:
                out = torch.empty(x.shape, dtype=x.dtype)
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._torch_norm(x)
        x = x + residual
        return self._torch_norm(x), x

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        if not (ops.takes_layer_ops(x) and self.weight.dtype == x.dtype):
            return False
        if residual is None:
            return x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1)
        return residual.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous()

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one (`x * (1 + w)`) and the whole
    computation runs in float32 before the cast back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)
