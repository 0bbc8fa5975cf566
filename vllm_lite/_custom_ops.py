"""The csrc native CPU ops (`vllm_lite._C`, built by setup.py when a compiler is present): the
attention ops; the fused decoder-layer ops (RMSNorm with the residual add, rotary embedding,
SiLU-and-mul); for the sampler a row-wise argmax, top-k/top-p sampling and the grammar
bitmask; the GGUF block matmul and dequantization; the two ends of the int8 W8A8 linear; and
the int8_per_token_head KV cache's write and decode; the Gated DeltaNet's decode step.

`is_available()` says whether they loaded; callers fall back to the torch reference when not.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


@functools.cache
def is_available() -> bool:
    try:
        import vllm_lite._C  # noqa: F401 - registers torch.ops.vllm_lite_C.*
    except ImportError as exc:
        logger.debug("vllm_lite._C not loaded (%s); using the torch attention path", exc)
        return False
    cpu_capability()  # a bad VLLM_LITE_CPU_CAPABILITY fails here, by name
    return True


@functools.cache
def amx_bf16_usable() -> bool:
    """Whether the extension is built and this CPU lets the process use AMX-BF16 tiles (the bf16
    linear and prefill attention ops need them)."""
    return is_available() and torch.ops.vllm_lite_C.amx_bf16_usable()


@functools.cache
def amx_int8_usable() -> bool:
    """Whether the extension is built and this CPU lets the process use AMX-INT8 tiles (the int8
    linear layers' matmul, `amx_int8_linear`)."""
    return is_available() and torch.ops.vllm_lite_C.amx_int8_usable()


def amx_int8_mm(xq: torch.Tensor, packed_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """int32 `xq [M, K] @ W^T` for int8 `xq` (contiguous rows) and W [out_features, K] int8 packed
    by `quantization.pack_int8_tiles`: the exact sums torch._int_mm gives, on AMX-INT8 tiles."""
    return torch.ops.vllm_lite_C.amx_int8_mm(xq, packed_weight, out_features)


def amx_int8_linear(x: torch.Tensor, packed_weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """A W8A8 linear layer in one op: `quantize_rows_int8(x)`, `amx_int8_mm` and
    `dequantize_int32` (+ bias) fused, the same values; x float32/bfloat16 [M, K] with contiguous
    rows, `weight_scale` float32 [N], the result of x's dtype."""
    return torch.ops.vllm_lite_C.amx_int8_linear(x, packed_weight, weight_scale, bias)


@functools.cache
def cpu_capability() -> str:
    """The ISA level the extension's per-ISA kernels run at: "avx512", "avx2" or "default" (the
    widest this CPU has, capped by VLLM_LITE_CPU_CAPABILITY; a value other than these three
    raises here, naming the variable)."""
    return torch.ops.vllm_lite_C.cpu_capability()


LAYER_OP_DTYPES = (torch.float32, torch.bfloat16)


def takes_layer_ops(x: torch.Tensor) -> bool:
    """Whether the fused layer ops below run on `x`: a float32/bfloat16 CPU tensor with the
    extension loaded (else the layers keep their torch code)."""
    return x.device.type == "cpu" and x.dtype in LAYER_OP_DTYPES and is_available()


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """`out = x * rsqrt(mean(x**2, -1) + eps) * weight`; x, out and weight of one dtype, x
    contiguous (or 2-D with contiguous rows), out contiguous. fp32 arithmetic, one rounding."""
    torch.ops.vllm_lite_C.rms_norm(out, x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual += x` (rounded to the dtype), then `x = rms_norm(residual)`."""
    torch.ops.vllm_lite_C.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Neox-style rotary in place on query `[T, Hq, D]` and key `[T, Hkv, D]` (contiguous last
    dimension; views into a fused qkv output are fine) at int64 `positions [T]`;
    `cos_sin_cache [max_position, D]` (the query's dtype) holds cos then sin of each pair."""
    torch.ops.vllm_lite_C.rotary_embedding(positions, query, key, cos_sin_cache)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """`out [rows, d] = silu(x[:, :d]) * x[:, d:]` for 2-D x with contiguous rows."""
    torch.ops.vllm_lite_C.silu_and_mul(out, x)


def gated_delta_rule_decode(states: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of each sequence through the Gated DeltaNet's delta rule, its state updated in
    place in `states` [slots, H, dk, dv] at `slots` (int64 [n]): float32 q, k [n, H, dk] (q
    scaled, both unit length), v [n, H, dv], decay / beta [n, H] -> the outputs [n, H, dv]
    (gated_delta_rule._delta_rule_step's, without gathering the states)."""
    return torch.ops.vllm_lite_C.gated_delta_rule_decode(states, slots, q.contiguous(), k.contiguous(),
                                                         v.contiguous(), decay.contiguous(), beta.contiguous())


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """key/value `[T, Hkv, D]` (strided rows allowed) -> `kv_cache` at `slot_mapping` (int64,
    -1 = skip), in place. Any dtype, as long as key, value and cache agree."""
    torch.ops.vllm_lite_C.reshape_and_cache(key, value, kv_cache, slot_mapping)


def paged_attention_decode(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> None:
    """One query token per sequence: query `[S, Hq, D]` -> `out` (contiguous, same shape) over
    the `seq_lens[s]` cached tokens of `block_table[s]` (int32), only the last `sliding_window`
    of them when given (blocks before the window are not read; float32 only). float32, or
    bfloat16 for query, out and cache alike (fp32 scores, softmax and accumulation inside)."""
    torch.ops.vllm_lite_C.paged_attention_decode(out, query, kv_cache, block_table, seq_lens, scale,
                                                 sliding_window or 0)


def reshape_and_cache_int8(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
    """float32/bfloat16 key/value `[T, Hkv, D]` quantized into an int8_per_token_head `kv_cache`
    (`[..., D + 4]` int8 rows: codes, then the fp32 scale) at `slot_mapping`; the bytes equal
    `attention.kv_quant.quantize_rows`."""
    torch.ops.vllm_lite_C.reshape_and_cache_int8(key, value, kv_cache, slot_mapping)


def paged_attention_decode_int8(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                                block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> None:
    """`paged_attention_decode` over an int8_per_token_head cache: float32 query and `out`
    (contiguous), no sliding window. Each query head is rounded to int8 by the cache rows' rule
    (as `torch_backend.decode_attention` does); scores are integer dot products of the codes times
    both scales, V codes are widened to fp32; softmax and sums in fp32."""
    torch.ops.vllm_lite_C.paged_attention_decode_int8(out, query, kv_cache, block_table, seq_lens, scale)


def paged_attention_prefill(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                            block_table: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> None:
    """Causal attention of each sequence's new tokens (rows `query_start[s]` onward, `query_lens[s]`
    of them, the last of its `seq_lens[s]` cached tokens) over its cached keys, into those rows of
    `out`; int32 `[S]` tables and `block_table [S, max_blocks]`. bf16 query `[T, Hq, D]` and out; a
    bf16 cache, or an int8_per_token_head one (its rows dequantized to bf16 as the torch path
    does); head_dim 64 or 128, block_size a multiple of 16, AMX-BF16 (`amx_bf16_usable`). fp32
    scores, softmax and sums, probabilities rounded to bf16 for the V product as in flash attention.
    The op reads each token's heads as one row: a query whose heads lie apart (the Transformers
    fallback's, transposed from transformers' [heads, tokens, dim]) is copied together first."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:  # (a view when the heads only look apart: one head)
        query = query.reshape(query.shape[0], -1).view(query.shape)
    torch.ops.vllm_lite_C.paged_attention_prefill(out, query, kv_cache, block_table, query_start, query_lens,
                                                  seq_lens, scale)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for float32 `[rows, vocab]` with a contiguous last dimension (the
    first maximum wins, as in torch), rows in parallel: ~15x torch's on a [256, 8192] batch."""
    return torch.ops.vllm_lite_C.argmax_rows(logits)


def pack_head_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 LM head weight `[vocab, hidden]` as `head_logits` / `greedy_head` stream it:
    panels of 16 vocabulary entries, k-major inside each (`[panels, hidden, 16]`), zero-padded
    to a multiple of 32 entries."""
    return torch.ops.vllm_lite_C.pack_head_panels(weight)


def head_logits(hidden: torch.Tensor, panels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`hidden [rows, K] @ weight.T`, float32 `[rows, vocab_size]`, from `pack_head_panels(weight)`:
    each logit one fp32 dot product summed in k order, whatever else is in the batch."""
    return torch.ops.vllm_lite_C.head_logits(hidden, panels, vocab_size)


def greedy_head(hidden: torch.Tensor, panels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`head_logits(hidden, panels, vocab_size).argmax(-1)` (the first maximum, as `argmax_rows`)
    without writing the logits: int64 `[rows]`."""
    return torch.ops.vllm_lite_C.greedy_head(hidden, panels, vocab_size)


def head_screen_supported() -> bool:
    """Whether `greedy_head_screened` runs here: AVX-512 with VNNI (Intel since Cascade Lake, AMD
    since Zen 4) at the AVX-512 level, or AVX2 as the kernels' level (AVX2 laptops, AMD before Zen
    4, or VLLM_LITE_CPU_CAPABILITY=avx2); not at the baseline level, nor on AVX-512 without VNNI."""
    return torch.ops.vllm_lite_C.head_screen_supported()


def pack_head_screen(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 LM head weight's int16 codes (per-column scale) and the per-column terms of
    `greedy_head_screened`'s error bound (`(codes, stats)`); the weight must be finite."""
    return torch.ops.vllm_lite_C.pack_head_screen(weight)


def greedy_head_screened(hidden: torch.Tensor, panels: torch.Tensor, codes: torch.Tensor, stats: torch.Tensor,
                         vocab_size: int) -> tuple[torch.Tensor, float]:
    """`greedy_head(hidden, panels, vocab_size)`, the same tokens bit for bit: int16 dot products
    (vpdpwssd on AVX-512 VNNI, vpmaddwd on AVX2) estimate each logit within a proven bound, and
    only the columns that could still be a row's first maximum are computed again as greedy_head
    computes them. Also returns what the
    recomputation cost, as a share of greedy_head's time over the same rows (estimated)."""
    return torch.ops.vllm_lite_C.greedy_head_screened(hidden, panels, codes, stats, vocab_size)


def top_k_top_p_sample(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       uniforms: torch.Tensor) -> torch.Tensor:
    """Random draw per row of float32 `[rows, vocab]` logits after top-k (int64, 0 = off) and
    top-p (float32, 1.0 = off) truncation, with one uniform per row: expected O(vocab) per row
    whatever the distribution (selection, not sorting). Rule: sample/ops/topk_topp.py."""
    return torch.ops.vllm_lite_C.top_k_top_p_sample(logits, top_k, top_p, uniforms)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Disallowed tokens of logits rows `rows` (int64 [m]) set to -inf, in place: float32 logits
    `[rows, vocab]` (contiguous last dimension), int32 `bitmask [m, words]` in xgrammar's layout
    (bit t % 32 of word t // 32 = token t allowed; tokens past words * 32 never are). The rule
    of sample/ops/grammar_mask.py's torch fallback, without its [m, vocab] temporaries."""
    torch.ops.vllm_lite_C.apply_token_bitmask_inplace(logits, bitmask, rows)


def gguf_gemm(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 `x [M, K] @ W.T` for a weight kept in GGUF blocks: `qweight` uint8 `[N, K / 32 *
    block bytes]` of ggml type `qtype` (3 = Q4_1, 8 = Q8_0); blocks widened to fp32 in registers,
    fp32 accumulation. Meant for decode-sized M (the weight is read once per 4 rows)."""
    return torch.ops.vllm_lite_C.gguf_gemm(x, qweight, qtype)


def gguf_dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 `[N, K]` from GGUF blocks (as `gguf_gemm` takes them)."""
    return torch.ops.vllm_lite_C.gguf_dequantize(qweight, qtype)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of float32/bfloat16 `x [M, K]` (contiguous rows): int8 `[M, K]` and
    float32 scales `[M, 1]`, scale = max(max|x| / 127, 1e-12), q = round(x / scale) (ties to
    even), in one pass: the rule of layers/quantization.py's torch fallback."""
    return torch.ops.vllm_lite_C.quantize_rows_int8(x)


def dequantize_int32(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`acc * row_scale[m] * col_scale[n] (+ bias[n])` for a contiguous int32 `acc [M, N]`, fp32
    arithmetic, rounded once to `dtype` (float32 or bfloat16; bias of that dtype)."""
    return torch.ops.vllm_lite_C.dequantize_int32(acc, row_scale, col_scale, bias, dtype)
