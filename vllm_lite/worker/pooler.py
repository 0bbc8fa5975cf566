"""The pooling runner's output (an embedding or classification model): one vector per prompt
from the final hidden states (a classifier's: through its head, the class logits), in place of a
sampled token.

A prompt may take several steps (chunked prefill): LAST reads the step that computes the prompt's
last token; MEAN sums every chunk's hidden states per request (a running sum, restarted whenever
a request computes from position 0: a preempted request starts over) and divides at the end; CLS
keeps the first position's. Prefix caching is off for MEAN and CLS (config: cached tokens are not
computed), so every prompt position passes through here. The vectors leave unnormalized: the
client normalizes each as its request says (vLLM's use_activation)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vllm_lite.config import PoolerConfig
from vllm_lite.host_to_device import host_to_device
from vllm_lite.worker.input_batch import InputBatch


class Pooler:
    def __init__(self, config: PoolerConfig, device: torch.device, head: nn.Module | None = None,
                 adapter_heads: dict[int, torch.Tensor] | None = None) -> None:
        """`head`: a classifier's head (the pooled state -> class logits); None: the vector itself.
        `adapter_heads`: the heads LoRA adapters replace it with, by adapter id (the LoRA
        manager's, kept up to date there)."""
        self.config = config
        self.device = device
        self.head = head
        self.adapter_heads = adapter_heads
        self._partial: dict[str, torch.Tensor] = {}  # MEAN: running sums; CLS: the first position's state

    def release(self, req_id: str) -> None:
        self._partial.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, batch: InputBatch, rows: np.ndarray, query_starts: np.ndarray,
             query_lens: np.ndarray, done: np.ndarray) -> dict[str, np.ndarray]:
        """`rows`: the batch rows this step computes (their tokens at `query_starts` in `hidden`,
        `query_lens` long; `num_computed_tokens` not yet advanced); `done`: which of them compute
        their prompt's last token now. Returns the finished requests' vectors (float32, not normalized)."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            self._accumulate_sums(hidden, batch, rows, query_starts, query_lens)
        elif kind == "CLS":
            self._keep_firsts(hidden, batch, rows, query_starts)
        finished = np.flatnonzero(done)
        if len(finished) == 0:
            return {}
        req_ids = [batch.req_ids[row] for row in rows[finished].tolist()]
        if kind == "LAST":
            last = query_starts[finished] + query_lens[finished] - 1
            pooled = hidden[host_to_device(last.astype(np.int64), self.device)].float()
        else:
            pooled = torch.stack([self._partial.pop(req_id) for req_id in req_ids])
            if kind == "MEAN":
                counts = batch.num_prompt_tokens[rows[finished]].astype(np.float32)[:, None]
                pooled = pooled / host_to_device(counts, self.device)
        if self.head is not None:
            pooled = self._classified(pooled.to(self.head.weight.dtype), batch.lora_ids[rows[finished]])
        vectors = pooled.cpu().numpy()
        return {req_id: vectors[i] for i, req_id in enumerate(req_ids)}

    def _classified(self, pooled: torch.Tensor, lora_ids: np.ndarray) -> torch.Tensor:
        """The head's logits (float32), each row's adapter's own head where it saved one."""
        logits = self.head(pooled).float()
        if self.adapter_heads and lora_ids.any():
            for adapter_id in np.unique(lora_ids[lora_ids > 0]).tolist():
                weight = self.adapter_heads.get(adapter_id)
                if weight is not None:
                    index = host_to_device(np.flatnonzero(lora_ids == adapter_id).astype(np.int64), self.device)
                    logits[index] = torch.nn.functional.linear(pooled[index], weight).float()
        return logits

    def _accumulate_sums(self, hidden: torch.Tensor, batch: InputBatch, rows: np.ndarray,
                         query_starts: np.ndarray, query_lens: np.ndarray) -> None:
        segments = host_to_device(np.repeat(np.arange(len(rows)), query_lens).astype(np.int64), self.device)
        total = int(query_lens.sum())
        sums = torch.zeros(len(rows), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segments, hidden[:total].float())
        starts = batch.num_computed_tokens[rows]
        for i, req_id in enumerate(batch.req_ids[row] for row in rows.tolist()):
            if starts[i] == 0 or req_id not in self._partial:  # a first chunk (again, after a preemption)
                self._partial[req_id] = sums[i]
            else:
                self._partial[req_id] = self._partial[req_id] + sums[i]

    def _keep_firsts(self, hidden: torch.Tensor, batch: InputBatch, rows: np.ndarray,
                     query_starts: np.ndarray) -> None:
        first = np.flatnonzero(batch.num_computed_tokens[rows] == 0)
        if len(first) == 0:
            return
        states = hidden[host_to_device(query_starts[first].astype(np.int64), self.device)].float()
        for j, row in enumerate(rows[first].tolist()):
            self._partial[batch.req_ids[row]] = states[j]
