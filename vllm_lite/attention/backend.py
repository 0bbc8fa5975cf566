"""The attention backend interface.

Per step the model runner builds one `CommonAttentionMetadata` (host + device tensors), the
backend turns it into its own metadata once (`build`), and every layer's forward receives that
object explicitly; there is no global per-step context.

KV cache per layer: `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (index 0 = K, 1 = V);
an int8_per_token_head cache has `head_dim + 4` int8 per row: the codes, then the row's fp32
scale (attention/kv_quant.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Sequences are the scheduled rows, in batch order; tokens are laid out sequence after
    sequence (sequence i owns tokens query_start_loc[i]:query_start_loc[i+1])."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], context + new tokens
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 = padding (not written)
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    num_actual_tokens: int
    max_query_len: int
    block_size: int
    # int32 [num_actual_tokens]: the keys (sequence positions 0 .. k - 1) each token attends,
    # where some token of the step attends past its own position (vLLM's "mm prefix LM", Gemma 3:
    # an image's placeholders see each other both ways); None: each token its position + 1
    key_ends_np: np.ndarray | None = None

    def rows_attending_ahead(self) -> np.ndarray:
        """The sequences with a token that attends keys past its own position (`key_ends_np`)."""
        if self.key_ends_np is None:
            return np.zeros(0, dtype=np.int64)
        counts = np.diff(self.query_start_loc_np)
        token_rows = np.repeat(np.arange(len(counts)), counts)
        first_positions = np.repeat(self.seq_lens_np - counts, counts)
        within = np.arange(self.num_actual_tokens) - np.repeat(self.query_start_loc_np[:-1], counts)
        ahead = self.key_ends_np[:self.num_actual_tokens] > first_positions + within + 1
        return np.unique(token_rows[ahead])


class AttentionBackend(ABC):
    name: str
    # Whether `forward` takes more query rows than the step's tokens (`num_actual_tokens`): the
    # CPU model runner pads a step to a matmul bucket size (worker/model_runner.py); the rows past
    # the step's tokens are attended by nobody (zeros out) and write no cache.
    takes_padded_rows: bool = False

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Backend-specific metadata, computed once per step and shared by all layers."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D] (T may exceed the step's tokens
        where `takes_padded_rows`). Writes key/value into the cache at the metadata's slots before
        attending (so sequences in the same step can read each other's freshly cached prefix
        blocks). A token sees the keys before its `key_ends_np` entry where the metadata has
        them (else positions up to its own). With `sliding_window` W the query at position p sees
        keys at positions p - W + 1 .. p only (transformers' convention; with key ends, from
        p - W + 1 up to them); blocks wholly before that may already hold
        other data (freed by the KV-cache manager). `logits_soft_cap` c: scores become
        c * tanh(score / c) before the softmax (Gemma 2). `alibi_slopes` [Hq] (float32): each
        score of a key at position j gains slope * j (ALiBi as Bloom adds it; the query's own
        position would shift a whole softmax row, which changes nothing). `sinks` [Hq] (float32):
        attention sinks (gpt-oss's): each head's softmax also takes its sink's logit in the
        denominator, which attends to no value."""


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, row_size: int) -> tuple[int, ...]:
    """row_size: elements of one (token, KV head) row (config.kv_cache_row)."""
    return (num_blocks, 2, block_size, num_kv_heads, row_size)
