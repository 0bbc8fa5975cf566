"""CPU attention with the csrc native ops (vllm_lite._C): the cache write and decode attention
run natively, and so does prefill (chunks, prefix-cache hits) of a bf16 model over a bf16 or
int8_per_token_head cache on CPUs with AMX-BF16 (head_dim 64/128, no sliding window or soft cap);
other prefill rows use the torch reference's SDPA path. In a mixed batch the decode rows go to
the native decode op together and the prefill rows to the native prefill op together (or each
to SDPA).

Needs the extension and float32 or bfloat16 (prefill SDPA then runs in bf16 too); `selector.get_attn_backend` falls back to the torch backend
otherwise. A bf16 KV cache under a float32 model (kv_cache_dtype="bfloat16") takes K/V rounded to
bf16 and decodes with the bf16 op (the query rounded to bf16, fp32 arithmetic inside); prefill
widens the gathered rows back to fp32 for SDPA. An int8_per_token_head cache is written and
decoded by its own ops (float32 query and output, any model dtype; no sliding window: such layers
take the torch path, which dequantizes what it gathers, as prefill does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.attention.kv_quant import is_int8_cache
from vllm_lite.attention.torch_backend import PrefillSeq, TorchAttentionBackend, decode_attention, prefill_attention


@dataclass(slots=True)
class CpuNativeAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_tokens: int
    decode_block_table: torch.Tensor | None = None  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # int32 [num_decodes]
    decode_token_idx: torch.Tensor | None = None  # int64 [num_decodes]; None = every token
    prefills: list[PrefillSeq] = field(default_factory=list)
    prefill_tables: PrefillTables | None = None


@dataclass(slots=True)
class PrefillTables:
    """The prefill rows for `paged_attention_prefill`, int32."""

    block_table: torch.Tensor  # [num_prefills, max_blocks]
    query_start: torch.Tensor  # [num_prefills] first token of each row in the step
    query_lens: torch.Tensor  # [num_prefills]
    seq_lens: torch.Tensor  # [num_prefills]


class CpuNativeAttentionBackend(AttentionBackend):
    name = "cpu_native"

    def __init__(self) -> None:
        if not cpu_native.is_available():
            raise RuntimeError("the csrc extension vllm_lite._C is not built")

    def build(self, common: CommonAttentionMetadata) -> CpuNativeAttentionMetadata:
        n = common.num_actual_tokens
        metadata = CpuNativeAttentionMetadata(common.slot_mapping[:n], n)
        qsl = common.query_start_loc_np
        is_decode = (qsl[1:] - qsl[:-1]) == 1  # one new token: it sees every cached key
        block_table, seq_lens = common.block_table.to(torch.int32), common.seq_lens.to(torch.int32)
        if is_decode.all():
            metadata.decode_block_table, metadata.decode_seq_lens = block_table, seq_lens
        elif is_decode.any():
            rows = torch.from_numpy(is_decode.nonzero()[0])
            metadata.decode_block_table = block_table[rows].contiguous()
            metadata.decode_seq_lens = seq_lens[rows]
            metadata.decode_token_idx = common.query_start_loc[:-1][rows].long()
        prefill_rows = (~is_decode).nonzero()[0]
        for row in prefill_rows.tolist():
            metadata.prefills.append(TorchAttentionBackend.build_prefill(common, row))
        if len(prefill_rows):
            rows = torch.from_numpy(prefill_rows)
            starts = qsl[prefill_rows]
            metadata.prefill_tables = PrefillTables(
                block_table[rows].contiguous(), torch.from_numpy(starts.astype(np.int32)),
                torch.from_numpy((qsl[prefill_rows + 1] - starts).astype(np.int32)), seq_lens[rows].contiguous())
        return metadata

    def forward(self, query, key, value, kv_cache, metadata: CpuNativeAttentionMetadata, scale,
                sliding_window=None, logits_soft_cap=None):
        int8_cache = is_int8_cache(kv_cache)
        self._write_cache(key, value, kv_cache, metadata.slot_mapping, int8_cache)
        out = torch.empty(query.shape, dtype=query.dtype)
        native_decode = logits_soft_cap is None and (sliding_window is None or kv_cache.dtype == torch.float32)
        if metadata.decode_seq_lens is not None and not native_decode:
            self._torch_decodes(out, query, kv_cache, metadata, scale, sliding_window, logits_soft_cap)
        elif metadata.decode_seq_lens is not None:
            idx = metadata.decode_token_idx
            # The native ops take query and output in one dtype: the cache's (a bf16 cache under a
            # float32 model rounds the query to bf16), float32 for an int8 cache; scores, softmax
            # and sums are fp32 either way.
            op_dtype = torch.float32 if int8_cache else kv_cache.dtype
            rows = (query if idx is None else query[idx]).to(op_dtype)
            decoded = out if idx is None and op_dtype == query.dtype else torch.empty(rows.shape, dtype=op_dtype)
            if int8_cache:
                cpu_native.paged_attention_decode_int8(decoded, rows, kv_cache, metadata.decode_block_table,
                                                       metadata.decode_seq_lens, scale)
            else:
                cpu_native.paged_attention_decode(decoded, rows, kv_cache, metadata.decode_block_table,
                                                  metadata.decode_seq_lens, scale, sliding_window)
            if decoded is not out:
                out[slice(None) if idx is None else idx] = decoded.to(query.dtype)
        if metadata.prefill_tables is not None and self._native_prefill(query, kv_cache, sliding_window, logits_soft_cap):
            tables = metadata.prefill_tables
            cpu_native.paged_attention_prefill(out, query, kv_cache, tables.block_table, tables.query_start,
                                               tables.query_lens, tables.seq_lens, scale)
            return out
        for seq in metadata.prefills:
            end = seq.token_start + seq.query_len
            out[seq.token_start:end] = prefill_attention(query[seq.token_start:end], kv_cache, seq, scale,
                                                         sliding_window, logits_soft_cap)
        return out

    @staticmethod
    def _native_prefill(query, kv_cache, sliding_window, logits_soft_cap) -> bool:
        """Whether `paged_attention_prefill` takes this layer's prefill rows (else SDPA per row)."""
        return (sliding_window is None and logits_soft_cap is None and query.dtype == torch.bfloat16
                and kv_cache.dtype in (torch.bfloat16, torch.int8) and query.shape[-1] in (64, 128)
                and kv_cache.shape[2] % 16 == 0 and cpu_native.amx_bf16_usable())

    @staticmethod
    def _write_cache(key, value, kv_cache, slot_mapping, int8_cache: bool) -> None:
        if int8_cache:
            cpu_native.reshape_and_cache_int8(key, value, kv_cache, slot_mapping)
        else:  # bf16 under a float32 model with kv_cache_dtype="bfloat16"
            cpu_native.reshape_and_cache(key.to(kv_cache.dtype), value.to(kv_cache.dtype), kv_cache, slot_mapping)

    @staticmethod
    def _torch_decodes(out, query, kv_cache, metadata: CpuNativeAttentionMetadata, scale,
                       sliding_window, logits_soft_cap) -> None:
        """The native decode op has no soft cap (Gemma 2) and no bf16 sliding window: such
        layers take the torch path."""
        idx = metadata.decode_token_idx
        rows = query if idx is None else query[idx]
        seq_lens = metadata.decode_seq_lens.long()
        bs = kv_cache.shape[2]
        max_blocks = -(-int(seq_lens.max()) // bs)
        positions = torch.arange(max_blocks * bs)
        mask = positions[None, :] < seq_lens[:, None]
        if sliding_window is not None:
            mask &= positions[None, :] >= (seq_lens - sliding_window)[:, None]
        decoded = decode_attention(rows, kv_cache, metadata.decode_block_table[:, :max_blocks].long(),
                                   mask[:, None, None, :], scale, logits_soft_cap)
        if idx is None:
            out.copy_(decoded)
        else:
            out[idx] = decoded
