"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.gguf_quant import gguf_embedding, gguf_weight_of
from vllm_lite.model.layers.head_panels import HeadPanels, greedy_tokens, head_panels_usable
from vllm_lite.model.layers.linear import PackedWeight, can_prepack, linear, materialize, narrow_loaded, prepack


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # The dtype of looked-up rows when the table is a GGUF weight kept in its blocks (uint8);
        # the loader sets it to the model dtype.
        self.output_dtype = torch.float32

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(materialize(narrow_loaded(loaded, 0, self.vocab_start, rows)))
        param.data[rows:].zero_()  # (the last rank's padding rows when the vocabulary does not split evenly)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        gguf_weight = gguf_weight_of(self.weight)
        if gguf_weight is not None:  # one rank only (config refuses GGUF kept quantized with TP)
            return gguf_embedding(input_ids, gguf_weight, self.output_dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered along the vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, bias: bool = False,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.packed_weight: PackedWeight | None = None
        self.tied = False
        self.bias: nn.Parameter | None = None  # (Phi-2's head has one: this rank's slice, as the weight's rows)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.shard_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        """As for linear layers, but an fp32 head on CPU is kept for the native LM-head kernels
        (layers/head_panels.py) rather than oneDNN; a tied weight stays row-major too, for the
        embedding lookup (a GGUF weight kept in its blocks is shared by both, never copied)."""
        gguf_weight = gguf_weight_of(self.weight)
        if gguf_weight is not None:
            self.packed_weight = gguf_weight
            if not self.tied:
                self.weight = nn.Parameter(torch.empty(gguf_weight.out_features, gguf_weight.in_features,
                                                       device="meta"), requires_grad=False)
            return
        if head_panels_usable(self.weight):
            self.packed_weight = HeadPanels.pack(self.weight)
        elif can_prepack(self.weight):
            self.packed_weight = prepack(self.weight)
        if self.packed_weight is not None and not self.tied:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits whatever the model dtype: sampling and logprobs work in fp32."""
        local = linear(hidden_states, self.weight, self.packed_weight)
        if self.bias is not None:  # (added here: the native head kernels take none)
            local = local + self.bias.to(local.dtype)
        logits = self.tp.all_gather(local, dim=-1)
        return logits[..., : self.vocab_size].float()

    def greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden_states).argmax(-1)` without the logits, int64 `[rows]` for
        `[rows, hidden]`, where the head runs on the native LM-head kernels on one rank; None
        elsewhere (the caller computes the logits)."""
        if not isinstance(self.packed_weight, HeadPanels) or self.tp.size > 1 or self.bias is not None:
            return None
        return greedy_tokens(hidden_states, self.packed_weight)
