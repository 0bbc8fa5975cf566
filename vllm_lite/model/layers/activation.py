from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a fused gate_up projection output [..., 2 * d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (transformers' `gelu_pytorch_tanh`), for a fused gate_up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
