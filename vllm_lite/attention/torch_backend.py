"""Reference attention over the paged KV cache in plain torch (CPU and CUDA).

Decode sequences (one query token) are attended in one batched SDPA call over their gathered
blocks with a key-padding mask; prefill sequences (chunks, possibly after a prefix-cache hit)
one SDPA call each with a causal mask offset by their context length. Attention always sees K and
V as the cache stores them (rounded to a bf16 cache, quantized in an int8_per_token_head one,
rounded to float8 in an fp8 one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.attention.kv_quant import dequantize_rows, is_int8_cache, quantize_rows

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # kv_cache_dtype "fp8" / "fp8_e4m3", "fp8_e5m2"


@dataclass(slots=True)
class PrefillSeq:
    token_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks_used]
    mask: torch.Tensor | None  # bool [query_len, seq_len]; None = plain causal (no context)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window -> mask

    def mask_for(self, sliding_window: int | None) -> torch.Tensor | None:
        """The causal mask, narrowed to the last `sliding_window` keys of each query (built
        once per step and window, shared by the layers with that window)."""
        if sliding_window is None or sliding_window >= self.seq_len:
            return self.mask
        mask = self.window_masks.get(sliding_window)
        if mask is None:
            device = self.block_ids.device
            q_pos = torch.arange(self.query_len, device=device)[:, None] + (self.seq_len - self.query_len)
            k_pos = torch.arange(self.seq_len, device=device)[None, :]
            mask = (k_pos > q_pos - sliding_window) & (k_pos <= q_pos if self.mask is None else self.mask)
            self.window_masks[sliding_window] = mask
        return mask


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_blocks: torch.Tensor  # [num_tokens] block index of each new token
    slot_offsets: torch.Tensor  # [num_tokens] offset inside the block
    decode_token_idx: torch.Tensor | None  # [num_decodes]
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # bool [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSeq]
    num_tokens: int
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes]
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def decode_mask_for(self, sliding_window: int | None) -> torch.Tensor | None:
        if sliding_window is None:
            return self.decode_mask
        mask = self.decode_window_masks.get(sliding_window)
        if mask is None:
            positions = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            first = (self.decode_seq_lens - sliding_window)[:, None, None, None]
            mask = self.decode_mask & (positions >= first)
            self.decode_window_masks[sliding_window] = mask
        return mask


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    takes_padded_rows = True

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        bs = common.block_size
        slots = common.slot_mapping[: common.num_actual_tokens]
        if bool((slots < 0).any()):
            raise ValueError("the torch backend does not take padded slot mappings")
        qsl = common.query_start_loc_np
        query_lens = qsl[1:] - qsl[:-1]
        decode_rows = (query_lens == 1).nonzero()[0]
        metadata = TorchAttentionMetadata(
            slot_blocks=slots // bs, slot_offsets=slots % bs, decode_token_idx=None,
            decode_block_table=None, decode_mask=None, prefills=[],
            num_tokens=common.num_actual_tokens,
        )
        if len(decode_rows):
            self._build_decodes(common, decode_rows, metadata)
        for row in (query_lens > 1).nonzero()[0].tolist():
            metadata.prefills.append(self.build_prefill(common, row))
        return metadata

    @staticmethod
    def _build_decodes(common: CommonAttentionMetadata, rows, metadata: TorchAttentionMetadata) -> None:
        bs = common.block_size
        rows_t = torch.from_numpy(rows).to(common.block_table.device)
        seq_lens = common.seq_lens[rows_t]
        max_blocks = -(-int(common.seq_lens_np[rows].max()) // bs)
        metadata.decode_token_idx = common.query_start_loc[:-1][rows_t].long()
        metadata.decode_block_table = common.block_table[rows_t, :max_blocks].long()
        positions = torch.arange(max_blocks * bs, device=seq_lens.device)
        metadata.decode_mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
        metadata.decode_seq_lens = seq_lens

    @staticmethod
    def build_prefill(common: CommonAttentionMetadata, row: int) -> PrefillSeq:
        bs = common.block_size
        start, end = int(common.query_start_loc_np[row]), int(common.query_start_loc_np[row + 1])
        query_len, seq_len = end - start, int(common.seq_lens_np[row])
        block_ids = common.block_table[row, : -(-seq_len // bs)].long()
        mask = None
        key_positions = torch.arange(seq_len, device=block_ids.device)[None, :]
        if common.key_ends_np is not None:  # (each token's own key end: an image's tokens see ahead)
            key_ends = torch.from_numpy(common.key_ends_np[start:end].astype(np.int64)).to(block_ids.device)
            mask = key_positions < key_ends[:, None]
        elif seq_len != query_len:
            context = seq_len - query_len
            q_pos = torch.arange(query_len, device=block_ids.device)[:, None] + context
            mask = key_positions <= q_pos
        return PrefillSeq(start, query_len, seq_len, block_ids, mask)

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale,
                sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
        n = metadata.num_tokens
        kv_cache[metadata.slot_blocks, 0, metadata.slot_offsets] = to_cache_rows(key[:n], kv_cache)
        kv_cache[metadata.slot_blocks, 1, metadata.slot_offsets] = to_cache_rows(value[:n], kv_cache)
        out = torch.empty_like(query)
        out[n:].zero_()  # rows past the step's tokens (`takes_padded_rows`)
        if metadata.decode_token_idx is not None:
            out[metadata.decode_token_idx] = decode_attention(
                query[metadata.decode_token_idx], kv_cache, metadata.decode_block_table,
                metadata.decode_mask_for(sliding_window), scale, logits_soft_cap, alibi_slopes, sinks)
        for seq in metadata.prefills:
            end = seq.token_start + seq.query_len
            out[seq.token_start:end] = prefill_attention(query[seq.token_start:end], kv_cache, seq, scale,
                                                         sliding_window, logits_soft_cap, alibi_slopes, sinks)
        return out


def to_cache_rows(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """[T, H, D] keys or values as the cache stores them: an fp8 cache saturates at the format's
    largest value (scale 1.0), as vLLM's conversions do, instead of storing inf or NaN."""
    if is_int8_cache(kv_cache):
        return quantize_rows(x)
    if kv_cache.dtype in FP8_DTYPES:
        largest = torch.finfo(kv_cache.dtype).max
        return x.float().clamp(-largest, largest).to(kv_cache.dtype)
    return x.to(kv_cache.dtype)


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_kv_heads, num_blocks * block_size, head_dim] in
    `dtype` (the query's: a bf16 cache under a float32 model is widened, an int8 one dequantized)."""
    blocks = kv_cache[block_ids, which]  # [..., nb, bs, H, D]
    merged = blocks.flatten(-4, -3)  # [..., nb * bs, H, D]
    merged = dequantize_rows(merged, dtype) if is_int8_cache(kv_cache) else merged.to(dtype)
    return merged.transpose(-3, -2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           logits_soft_cap: float | None, alibi_slopes: torch.Tensor | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., H, L, D] (GQA: fewer k/v heads), causal when `mask` is None. With a soft
    cap the scores are `cap * tanh(score / cap)` before the mask (Gemma 2), with ALiBi slopes
    [H] they gain slope * key position (Bloom), with sinks [H] each row's softmax also counts
    its head's sink logit (gpt-oss); all computed explicitly."""
    if logits_soft_cap is None and alibi_slopes is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if alibi_slopes is not None:
        key_positions = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.float32)
        scores = scores + (alibi_slopes[:, None, None] * key_positions).to(scores.dtype)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink_logits = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat((scores, sink_logits), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights, v)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     mask: torch.Tensor, scale: float, logits_soft_cap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row: query [B, Hq, D] over `block_table` [B, nb] (int64) with a key
    mask [B, 1, 1, nb * block_size]. Over an int8_per_token_head cache each query head is rounded
    to its own int8 quantization (the cache rows' rule; the csrc op multiplies int8 codes) and the
    attention runs in fp32."""
    dtype = query.dtype
    if is_int8_cache(kv_cache):
        query = dequantize_rows(quantize_rows(query), torch.float32)
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    k = _gather(kv_cache, block_table, 0, query.dtype)  # [B, Hkv, S, D]
    v = _gather(kv_cache, block_table, 1, query.dtype)
    return attend(q, k, v, mask, scale, logits_soft_cap, alibi_slopes, sinks).squeeze(2).to(dtype)


def prefill_attention(query, kv_cache, seq: PrefillSeq, scale, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    q = query.transpose(0, 1)  # [Hq, L, D]
    k = _gather(kv_cache, seq.block_ids, 0, query.dtype)[:, : seq.seq_len]
    v = _gather(kv_cache, seq.block_ids, 1, query.dtype)[:, : seq.seq_len]
    # With a batch dimension CPU torch takes its flash-attention kernel; 3-D inputs fall to the
    # math path, 2-5x slower at prompt lengths of 300-2,048 (measured, torch 2.13).
    out = attend(q[None], k[None], v[None], seq.mask_for(sliding_window), scale, logits_soft_cap, alibi_slopes, sinks)
    return out[0].transpose(0, 1)
