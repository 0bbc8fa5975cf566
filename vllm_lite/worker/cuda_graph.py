"""CUDA graphs for decode steps (CUDA only; `enforce_eager=True` turns them off).

A decode step (every scheduled row has exactly one new token) with at most the largest captured
batch size replays the graph captured for the smallest captured size that holds it. The model
forward was captured reading static input buffers; a replay copies the step's inputs into them:

| buffer          | rows [0, n)          | padded rows [n, size)                               |
|-----------------|----------------------|-----------------------------------------------------|
| input_ids       | the step's tokens    | stale (any valid token id)                          |
| positions       | the step's positions | stale (any valid position)                          |
| slot_mapping    | the step's slots     | -1: reshape_and_cache writes nothing                |
| seq_lens        | the step's lengths   | 0: attention reads no key and outputs zeros         |
| block_table     | the step's rows      | stale, never read (seq_len 0)                       |
| query_start_loc | 0, 1, ..., size      | (fixed: one token per row)                          |

Only backends that declare `supports_cuda_graphs` (the Triton one: no host work per layer, no
host synchronization) are captured. Graphs share one memory pool and are captured largest
first; the output of a replay is a view of the graph's static output, valid until the next
replay. CPU never uses graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.config import VllmConfig, max_blocks_per_seq

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def cuda_graph_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to min(max_num_seqs, MAX_CAPTURE_SIZE) (included)."""
    largest = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = {s for s in (1, 2, 4) if s <= largest} | set(range(8, largest + 1, 8)) | {largest}
    return sorted(sizes)


def maybe_capture_cuda_graphs(config: VllmConfig, model: nn.Module, backend: AttentionBackend,
                              kv_caches: list[torch.Tensor], device: torch.device) -> CudaGraphRunner | None:
    """The captured runner, or None on CPU, with enforce_eager, with LoRA (a step's adapters group
    its tokens differently each step), or with a backend or a layer that cannot be captured."""
    if (device.type != "cuda" or config.model_config.enforce_eager or config.lora_config is not None
            or not getattr(backend, "supports_cuda_graphs", False)):
        return None
    uncapturable = sorted({type(m).__name__ for m in model.modules()
                           if not getattr(m, "cuda_graph_capturable", True)})
    if uncapturable:
        logger.info("CUDA graphs off: %s cannot be captured; decode steps run eagerly", ", ".join(uncapturable))
        return None
    block_size = config.cache_config.block_size
    max_blocks = max_blocks_per_seq(config.model_config.max_model_len, block_size)
    runner = CudaGraphRunner(model, backend, kv_caches, config.scheduler_config.max_num_seqs,
                             max_blocks, block_size, device)
    runner.capture()
    return runner


class CudaGraphRunner:
    def __init__(self, model: nn.Module, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = cuda_graph_capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata: dict[int, Any] = {}  # keeps each graph's metadata (and its views) alive

    def _common(self, size: int) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc_np=np.arange(size + 1, dtype=np.int32),
            seq_lens_np=np.zeros(size, dtype=np.int32), num_actual_tokens=size, max_query_len=1,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.slot_mapping.fill_(-1)  # capture runs write nothing into the KV cache
        self.seq_lens.zero_()
        for size in reversed(self.sizes):
            metadata = self.backend.build(self._common(size))
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
            self.graphs[size], self.outputs[size] = self._capture_one(args, pool)
            self.metadata[size] = metadata
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes %s..%s) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def _capture_one(self, args: tuple, pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.model(*args)  # warm-up: compiles the Triton kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.model(*args)
        return graph, output

    def can_replay(self, metadata: Any) -> bool:
        """A decode-only step that fits the largest graph. `metadata` is the backend's (it
        carries max_query_len and num_actual_tokens, as the Triton backend's does)."""
        return metadata.max_query_len == 1 and metadata.num_actual_tokens <= self.sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        n = metadata.num_actual_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids[:n])
        self.positions[:n].copy_(positions[:n])
        self.slot_mapping[:n].copy_(metadata.slot_mapping[:n])
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens[:n])
        self.seq_lens[n:size].zero_()
        width = metadata.block_table.shape[1]
        self.block_table[:n, :width].copy_(metadata.block_table[:n])
        self.graphs[size].replay()
        return self.outputs[size][:n]
