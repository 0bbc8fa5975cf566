"""CPU attention with the csrc native ops (vllm_lite._C): the cache write and decode attention
run natively, and so do short prefill rows: each of their query tokens is a decode row of its own
(its sequence's blocks, its position + 1 keys), so every short prompt of a step is attended in
the one decode-op call, causal by construction, instead of a gather and an SDPA call per
sequence and layer. Prefill rows longer than PER_TOKEN_PREFILL_MAX_KEYS keys take the torch
reference's SDPA path (its tiled kernel reuses each key across queries; the decode op re-reads
them per token), or, for a bf16 model over a bf16 or int8_per_token_head cache on CPUs with
AMX-BF16 (head_dim 64/128, no sliding window or soft cap), the native prefill op, which takes
every prefill row of such a step.

Needs the extension and float32 or bfloat16 (prefill SDPA then runs in bf16 too); `selector.get_attn_backend` falls back to the torch backend
otherwise. A bf16 KV cache under a float32 model (kv_cache_dtype="bfloat16") takes K/V rounded to
bf16 and decodes with the bf16 op (the query rounded to bf16, fp32 arithmetic inside); prefill
widens the gathered rows back to fp32 for SDPA. An int8_per_token_head cache is written and
decoded by its own ops (float32 query and output, any model dtype; no sliding window: such layers
take the torch path, which dequantizes what it gathers, as prefill does; its prefill rows all take
SDPA, since its decode op rounds the query to int8 as well). An fp8 cache (vLLM's "fp8" /
"fp8_e5m2", scale 1.0) is written as the torch reference writes it (saturated, then copied) and
decoded by the bf16 op's kernels reading the float8 bytes: with a bf16 model's query and output
on the AMX tile passes where they fit (each tile of rows widened to bf16, exactly), else with a
float32 query and output (the torch path's arithmetic); prefill widens what it gathers. Layers the decode op does not take (soft caps; bf16 or fp8
sliding windows) run their decode rows in torch and every prefill row through SDPA."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.attention.kv_quant import is_int8_cache
from vllm_lite.attention.torch_backend import (FP8_DTYPES, PrefillSeq, TorchAttentionBackend, decode_attention,
                                              prefill_attention, to_cache_rows)
from vllm_lite.ragged import segment_offsets


# Prefill rows of at most this many keys (context + new tokens) are attended token by token by
# the decode op; longer ones by SDPA. fp32, 2 threads, AVX2 EPYC (benchmarks/RESULTS.md,
# "Eighteenth session"): the decode op against a gather + SDPA call per sequence was 10x faster
# for 248 prompts of 16-48 tokens (tiny model), 1.9x for 64 x 128 and 1.1-1.5x at 256 keys, even
# at 512, and 0.55x at 2,048 keys (a 16-token chunk after 2,032 cached ones included: the decode op
# reads every key once per query token).
PER_TOKEN_PREFILL_MAX_KEYS = 256


@dataclass(slots=True)
class TokenRows:
    """Query tokens for the decode op: one row each, with its sequence's blocks and its own
    number of keys (a decode row's sequence length; a prefill token's position + 1)."""

    block_table: torch.Tensor  # int32 [num_rows, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_rows]
    token_idx: torch.Tensor | None  # int64 [num_rows] tokens of the step; None = every token


@dataclass(slots=True)
class CpuNativeAttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_tokens: int
    decodes: TokenRows | None = None  # rows with one new token
    short_prefills: TokenRows | None = None  # the tokens of prefill rows of <= PER_TOKEN_PREFILL_MAX_KEYS keys
    long_prefills: list[PrefillSeq] = field(default_factory=list)  # those longer than that (SDPA)
    common: CommonAttentionMetadata | None = None
    prefill_rows: np.ndarray | None = None  # None: the step has no prefill row
    attends_ahead: bool = False  # some token sees keys past its position (key_ends_np): masked SDPA
    _every_prefill: list[PrefillSeq] | None = None
    _prefill_tables: PrefillTables | None = None

    def every_prefill(self) -> list[PrefillSeq]:
        """Every prefill row as an SDPA sequence, for the layers the decode op does not take;
        built the first time one asks (a step of short prompts and native layers never does)."""
        if self.prefill_rows is None:
            return []
        if self._every_prefill is None:
            long_rows = {seq.token_start: seq for seq in self.long_prefills}
            starts = self.common.query_start_loc_np
            self._every_prefill = [long_rows.get(int(starts[row]))
                                   or TorchAttentionBackend.build_prefill(self.common, row)
                                   for row in self.prefill_rows.tolist()]
        return self._every_prefill

    def prefill_tables(self) -> PrefillTables:
        """Every prefill row for the AMX prefill op; built the first time a layer takes it (on a
        CPU without AMX-BF16, never)."""
        if self._prefill_tables is None:
            rows, qsl = self.prefill_rows, self.common.query_start_loc_np
            index = torch.from_numpy(rows)
            self._prefill_tables = PrefillTables(
                self.common.block_table[index].to(torch.int32), torch.from_numpy(qsl[rows].astype(np.int32)),
                torch.from_numpy((qsl[rows + 1] - qsl[rows]).astype(np.int32)),
                self.common.seq_lens[index].to(torch.int32))
        return self._prefill_tables


@dataclass(slots=True)
class PrefillTables:
    """The prefill rows for `paged_attention_prefill`, int32."""

    block_table: torch.Tensor  # [num_prefills, max_blocks]
    query_start: torch.Tensor  # [num_prefills] first token of each row in the step
    query_lens: torch.Tensor  # [num_prefills]
    seq_lens: torch.Tensor  # [num_prefills]


class CpuNativeAttentionBackend(AttentionBackend):
    name = "cpu_native"
    takes_padded_rows = True

    def __init__(self) -> None:
        if not cpu_native.is_available():
            raise RuntimeError("the csrc extension vllm_lite._C is not built")

    def build(self, common: CommonAttentionMetadata) -> CpuNativeAttentionMetadata:
        n = common.num_actual_tokens
        slot_mapping = common.slot_mapping if len(common.slot_mapping) == n else common.slot_mapping[:n]
        metadata = CpuNativeAttentionMetadata(slot_mapping, n)
        block_table, seq_lens = _int32(common.block_table), _int32(common.seq_lens)
        if common.max_query_len == 1:  # every row a decode (a steady step: no array looked at)
            metadata.decodes = TokenRows(block_table, seq_lens, None)
            return metadata
        qsl = common.query_start_loc_np
        is_decode = (qsl[1:] - qsl[:-1]) == 1  # one new token: it sees every cached key
        if is_decode.any():
            rows = torch.from_numpy(is_decode.nonzero()[0])
            metadata.decodes = TokenRows(block_table[rows].contiguous(), seq_lens[rows],
                                         common.query_start_loc[:-1][rows].long())
        prefill_rows = (~is_decode).nonzero()[0]
        metadata.common, metadata.prefill_rows = common, prefill_rows
        short = common.seq_lens_np[prefill_rows] <= PER_TOKEN_PREFILL_MAX_KEYS
        ahead = common.rows_attending_ahead()
        if len(ahead):  # (the decode op and the prefill op attend causally: such rows take SDPA's mask)
            metadata.attends_ahead = True
            short &= ~np.isin(prefill_rows, ahead)
        metadata.long_prefills = [TorchAttentionBackend.build_prefill(common, row)
                                  for row in prefill_rows[~short].tolist()]
        if short.any():
            metadata.short_prefills = self._token_rows(common, block_table, prefill_rows[short])
        return metadata

    @staticmethod
    def _token_rows(common: CommonAttentionMetadata, block_table: torch.Tensor, rows: np.ndarray) -> TokenRows:
        """One decode-op row per new token of `rows` (prefill rows of at most
        PER_TOKEN_PREFILL_MAX_KEYS keys): its row's blocks, as many as those keys need, and its
        position + 1 keys."""
        qsl = common.query_start_loc_np
        counts = qsl[rows + 1] - qsl[rows]
        offsets = segment_offsets(counts)
        lens = np.repeat(common.seq_lens_np[rows] - counts, counts) + offsets + 1
        width = -(-int(common.seq_lens_np[rows].max()) // common.block_size)
        table = block_table[torch.from_numpy(np.repeat(rows, counts)), :width]
        every_token = len(offsets) == common.num_actual_tokens  # (the step holds only these rows)
        token_idx = None if every_token else torch.from_numpy(np.repeat(qsl[rows], counts) + offsets)
        return TokenRows(table, torch.from_numpy(lens.astype(np.int32)), token_idx)

    def forward(self, query, key, value, kv_cache, metadata: CpuNativeAttentionMetadata, scale,
                sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
        """Rows past the step's tokens (`takes_padded_rows`): zeros in the output."""
        out = step_out = torch.empty(query.shape, dtype=query.dtype)
        n = metadata.num_tokens
        if query.shape[0] > n:
            out[n:].zero_()
            step_out, query, key, value = out[:n], query[:n], key[:n], value[:n]
        self._attend(step_out, query, key, value, kv_cache, metadata, scale, sliding_window, logits_soft_cap,
                     alibi_slopes, sinks)
        return out

    def _attend(self, out, query, key, value, kv_cache, metadata: CpuNativeAttentionMetadata, scale,
                sliding_window, logits_soft_cap, alibi_slopes=None, sinks=None) -> None:
        int8_cache = is_int8_cache(kv_cache)
        self._write_cache(key, value, kv_cache, metadata.slot_mapping, int8_cache)
        native_decode = (logits_soft_cap is None and alibi_slopes is None and sinks is None
                         and (sliding_window is None or kv_cache.dtype == torch.float32))
        if not native_decode:
            if metadata.decodes is not None:
                self._torch_decodes(out, query, kv_cache, metadata.decodes, scale, sliding_window, logits_soft_cap,
                                    alibi_slopes, sinks)
            self._sdpa_prefills(out, query, kv_cache, metadata.every_prefill(), scale, sliding_window,
                                logits_soft_cap, alibi_slopes, sinks)
            return
        if metadata.decodes is not None:
            self._decode(out, query, kv_cache, metadata.decodes, scale, sliding_window, int8_cache)
        if metadata.prefill_rows is None:
            return
        if not metadata.attends_ahead and self._native_prefill(query, kv_cache, sliding_window, logits_soft_cap):
            tables = metadata.prefill_tables()
            cpu_native.paged_attention_prefill(out, query, kv_cache, tables.block_table, tables.query_start,
                                               tables.query_lens, tables.seq_lens, scale)
            return
        if metadata.short_prefills is None or int8_cache:  # (the int8 op rounds each query to int8 too)
            self._sdpa_prefills(out, query, kv_cache, metadata.every_prefill(), scale, sliding_window, None)
            return
        self._decode(out, query, kv_cache, metadata.short_prefills, scale, sliding_window, int8_cache)
        self._sdpa_prefills(out, query, kv_cache, metadata.long_prefills, scale, sliding_window, None)

    @staticmethod
    def _decode(out, query, kv_cache, rows: TokenRows, scale, sliding_window, int8_cache: bool) -> None:
        """The decode op over `rows`. The native ops take query and output in one dtype: the
        cache's (a bf16 cache under a float32 model rounds the query to bf16), float32 for an int8
        cache, the model's for an fp8 cache (bf16, or else float32); scores, softmax and sums are
        fp32 either way."""
        idx = rows.token_idx
        if int8_cache:
            op_dtype = torch.float32
        elif kv_cache.dtype in FP8_DTYPES:
            op_dtype = torch.bfloat16 if query.dtype == torch.bfloat16 else torch.float32
        else:
            op_dtype = kv_cache.dtype
        queries = (query if idx is None else query[idx]).to(op_dtype)
        decoded = out if idx is None and op_dtype == query.dtype else torch.empty(queries.shape, dtype=op_dtype)
        if int8_cache:
            cpu_native.paged_attention_decode_int8(decoded, queries, kv_cache, rows.block_table, rows.seq_lens, scale)
        else:
            cpu_native.paged_attention_decode(decoded, queries, kv_cache, rows.block_table, rows.seq_lens, scale,
                                              sliding_window)
        if decoded is not out:
            out[slice(None) if idx is None else idx] = decoded.to(query.dtype)

    @staticmethod
    def _sdpa_prefills(out, query, kv_cache, prefills: list[PrefillSeq], scale, sliding_window,
                       logits_soft_cap, alibi_slopes=None, sinks=None) -> None:
        for seq in prefills:
            end = seq.token_start + seq.query_len
            out[seq.token_start:end] = prefill_attention(query[seq.token_start:end], kv_cache, seq, scale,
                                                         sliding_window, logits_soft_cap, alibi_slopes, sinks)

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
        elif kv_cache.dtype in FP8_DTYPES:
            cpu_native.reshape_and_cache(to_cache_rows(key, kv_cache), to_cache_rows(value, kv_cache), kv_cache,
                                         slot_mapping)
        else:  # bf16 under a float32 model with kv_cache_dtype="bfloat16"
            cpu_native.reshape_and_cache(key.to(kv_cache.dtype), value.to(kv_cache.dtype), kv_cache, slot_mapping)

    @staticmethod
    def _torch_decodes(out, query, kv_cache, decodes: TokenRows, scale, sliding_window, logits_soft_cap,
                       alibi_slopes=None, sinks=None) -> None:
        """The native decode op has no soft cap (Gemma 2), no ALiBi (Bloom), no sinks (gpt-oss)
        and no bf16 sliding window: such layers take the torch path."""
        idx = decodes.token_idx
        rows = query if idx is None else query[idx]
        seq_lens = decodes.seq_lens.long()
        bs = kv_cache.shape[2]
        max_blocks = -(-int(seq_lens.max()) // bs)
        positions = torch.arange(max_blocks * bs)
        mask = positions[None, :] < seq_lens[:, None]
        if sliding_window is not None:
            mask &= positions[None, :] >= (seq_lens - sliding_window)[:, None]
        decoded = decode_attention(rows, kv_cache, decodes.block_table[:, :max_blocks].long(),
                                   mask[:, None, None, :], scale, logits_soft_cap, alibi_slopes, sinks)
        if idx is None:
            out.copy_(decoded)
        else:
            out[idx] = decoded


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    """(No torch call for a tensor that is int32 already, as the model runner's are.)"""
    return tensor if tensor.dtype == torch.int32 else tensor.to(torch.int32)
