from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend


class Attention(nn.Module):
    """Paged attention for one layer; the backend, KV cache and metadata come in explicitly."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 sliding_window: int | None = None, scale: float | None = None,
                 logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
        """`alibi_slopes`: this rank's heads' ALiBi slopes (float32 [num_heads])."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window  # keys a query sees, itself included; None = all
        self.logits_soft_cap = logits_soft_cap
        self.backend = backend
        # A plain attribute, not a buffer, so it stays float32 when the model is cast; it follows
        # the model to its device at the first forward (`model.to(device)` moves buffers only).
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        if self.alibi_slopes is None:
            out = self.backend.forward(query, key, value, kv_cache, attn_metadata, self.scale,
                                       self.sliding_window, self.logits_soft_cap)
        else:
            if self.alibi_slopes.device != query.device:
                self.alibi_slopes = self.alibi_slopes.to(query.device)
            out = self.backend.forward(query, key, value, kv_cache, attn_metadata, self.scale,
                                       self.sliding_window, self.logits_soft_cap, self.alibi_slopes)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
