"""Triton attention backend (CUDA; on CPU only under TRITON_INTERPRET=1, for tests).

`build` does no host work beyond reading two ints, so the same metadata object, filled from
static buffers, can be captured in a CUDA graph (vllm_lite/worker/cuda_graph.py). Padded
tokens carry slot -1 (not written) and padded sequences seq_len 0 (output zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.attention.torch_backend import PrefillSeq, TorchAttentionBackend, prefill_attention
from vllm_lite.attention.ops.triton_reshape_and_cache import reshape_and_cache
from vllm_lite.attention.ops.triton_unified_attention import split_kv_attention, unified_attention

# Decode batches with fewer (sequence, kv head) pairs than this split each sequence's keys
# across NUM_SEGMENTS programs: below it the plain grid leaves most of a GPU's SMs idle.
SPLIT_KV_MAX_PROGRAMS = 128
NUM_SEGMENTS = 16


@dataclass(slots=True)
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 = padding
    num_actual_tokens: int
    num_seqs: int
    max_query_len: int
    # rows with tokens that attend past their position (key_ends_np; Gemma 3's image tokens): the
    # kernels attend causally, so these rows are attended again by the torch reference's masked SDPA
    attending_ahead: list[PrefillSeq] | None = None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        ahead = common.rows_attending_ahead().tolist() if common.key_ends_np is not None else []
        return TritonAttentionMetadata(
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
            block_table=common.block_table, slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens, num_seqs=common.seq_lens.shape[0],
            max_query_len=common.max_query_len,
            attending_ahead=[TorchAttentionBackend.build_prefill(common, row) for row in ahead] or None,
        )

    def forward(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata, scale,
                sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        args = (out, query, kv_cache, metadata.block_table, metadata.seq_lens,
                metadata.query_start_loc, scale)
        terms = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                     sinks=sinks)
        if metadata.max_query_len == 1 and metadata.num_seqs * kv_cache.shape[3] < SPLIT_KV_MAX_PROGRAMS:
            split_kv_attention(*args, num_segments=NUM_SEGMENTS, **terms)
        else:
            unified_attention(*args, **terms)
        for seq in metadata.attending_ahead or ():
            end = seq.token_start + seq.query_len
            out[seq.token_start:end] = prefill_attention(query[seq.token_start:end], kv_cache, seq, scale, **terms)
        return out
