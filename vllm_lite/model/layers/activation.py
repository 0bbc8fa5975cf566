from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite import _custom_ops as ops


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a fused gate_up projection output [..., 2 * d]: one csrc pass on CPU
    (fp32 arithmetic, one rounding), torch's two ops elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.takes_layer_ops(x) and x.dim() == 2 and x.stride(1) == 1:
            out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
            ops.silu_and_mul(out, x)
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (transformers' `gelu_pytorch_tanh`), for a fused gate_up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


# transformers' gelu names -> F.gelu's `approximate` (the tanh forms are one formula)
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}


class Gelu(nn.Module):
    """A plain (not gated) MLP's gelu, by the config's `hidden_act` name."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


class QuickGelu(nn.Module):
    """transformers' `quick_gelu` (CLIP's): x * sigmoid(1.702 x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def plain_activation(hidden_act: str) -> nn.Module:
    """A plain (not gated) activation by transformers' name (vision_config.PLAIN_ACTIVATIONS)."""
    if hidden_act == "quick_gelu":
        return QuickGelu()
    if hidden_act == "relu":
        return nn.ReLU()
    if hidden_act == "silu":
        return nn.SiLU()
    return Gelu(hidden_act)
