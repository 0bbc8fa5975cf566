"""Rotary position embedding (neox / rotate-half style), with linear, llama3, YaRN and longrope
scaling, and Qwen2-VL's multimodal rotary positions (M-RoPE)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm_lite import _custom_ops as ops


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(head_dim: int, base: float, max_model_len: int,
                       scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors (`short_factor` up to the original context) and
    cos/sin scaled by sqrt(1 + ln(factor) / ln(original)). transformers switches the whole
    sequence to `long_factor` once it grows past the original context, recomputing nothing
    already cached; that is not reproduced here, so longer contexts are refused."""
    original = scaling["original_max_position_embeddings"]
    if max_model_len > original:
        raise ValueError(f"rope_scaling longrope: max_model_len={max_model_len} exceeds "
                         f"original_max_position_embeddings={original}; long_factor scaling is not "
                         f"implemented, set max_model_len <= {original}")
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    mscale = scaling.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (short * base ** exponents), float(mscale)


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): frequencies that turn fewer than
    `beta_slow` times over the pretrained context are interpolated by `factor`, those that turn
    more than `beta_fast` times are kept, a linear ramp between; cos/sin are scaled by the
    attention factor (given, or 0.1 ln(factor) + 1, or DeepSeek's mscale ratio)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    low = _yarn_correction_dim(scaling.get("beta_fast") or 32, head_dim, base, original)
    high = _yarn_correction_dim(scaling.get("beta_slow") or 1, head_dim, base, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolation * ramp + extrapolation * (1 - ramp), float(attention_factor)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_correction_dim(rotations: float, head_dim: int, base: float, context: int) -> float:
    """The dimension whose frequency turns `rotations` times over `context` positions."""
    return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None, interleaved: bool = False) -> None:
        """`interleaved`: the pairs turned are neighbours (x0, x1), (x2, x3), ... (GPT-J's
        rotate_every_two) rather than the two halves of the head (NEOX style, the csrc op's);
        such a layer takes the torch path."""
        super().__init__()
        self.interleaved = interleaved
        inv_freq = _inv_freq(head_dim, base)
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        mscale = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":  # positions divided by the factor
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, mscale = _yarn_inv_freq(head_dim, base, rope_scaling)
        elif rope_type in ("longrope", "su"):
            inv_freq, mscale = _longrope_inv_freq(head_dim, base, max_position - 1, rope_scaling)
        elif rope_type != "default":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported "
                             "(supported: default, linear, llama3, yarn, longrope)")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * mscale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * mscale, persistent=False)
        # vLLM's layout for the csrc op: cos of each rotated pair, then sin ([max_position, D]);
        # like the caches above it takes the model's dtype when the model is cast.
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), -1),
                             persistent=False)
        # M-RoPE (`use_mrope`): which of a token's three positions turns each rotated pair
        self.mrope_position_of_pair: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq, D], key [T, Hkv, D]; on CPU rotated in place by the csrc op (fp32
        arithmetic, one rounding), else new tensors from torch ops. A layer made for fewer
        dimensions than D (partial rotary: GPT-NeoX's rotary_pct) rotates the first ones only."""
        if positions.dim() == 2:
            return self._multimodal(positions, query, key)
        rotary_dim = self.cos_sin_cache.shape[-1]
        if rotary_dim < query.shape[-1]:
            return self._partial(positions, query, key, rotary_dim)
        if self._native(positions, query, key):
            ops.rotary_embedding(positions, query, key, self.cos_sin_cache)
            return query, key
        cos = self.cos_cache[positions].unsqueeze(1).to(query.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(query.dtype)
        rotate = _rotate_every_two if self.interleaved else rotate_half
        return query * cos + rotate(query) * sin, key * cos + rotate(key) * sin

    def _multimodal(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen2-VL's M-RoPE: `positions` [3, T] are each token's temporal, height and width
        positions (all three its sequence position plus a shift, except on an image's
        placeholders); the rotated pairs are split into the sections `use_mrope` set, section k
        turned by the k-th positions. Each token's cos / sin row gathered from the cache, then the
        same rotation (the csrc op over per-token rows on CPU)."""
        pairs = self.cos_sin_cache.shape[-1] // 2
        if self.mrope_position_of_pair is None:
            raise ValueError("multimodal rotary positions given to a rotary layer without M-RoPE sections")
        pair = torch.arange(pairs, device=positions.device)
        per_pair = positions[self.mrope_position_of_pair.to(positions.device)].T  # [T, pairs]
        rows = torch.cat((self.cos_sin_cache[per_pair, pair], self.cos_sin_cache[per_pair, pair + pairs]), dim=-1)
        token_rows = torch.arange(len(rows), device=positions.device)
        if self._native(token_rows, query, key):
            ops.rotary_embedding(token_rows, query, key, rows)
            return query, key
        cos, sin = rows[:, :pairs], rows[:, pairs:]
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(query.dtype)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(query.dtype)
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin

    def _partial(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        query_rot, key_rot = query[..., :rotary_dim], key[..., :rotary_dim]
        if self._native(positions, query_rot, key_rot):  # (the op takes the views: rows by stride)
            ops.rotary_embedding(positions, query_rot, key_rot, self.cos_sin_cache)
            return query, key
        query_rot, key_rot = self.forward(positions, query_rot, key_rot)
        return (torch.cat((query_rot, query[..., rotary_dim:]), dim=-1),
                torch.cat((key_rot, key[..., rotary_dim:]), dim=-1))

    def _native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
        return (not self.interleaved and ops.takes_layer_ops(query)
                and key.dtype == query.dtype == self.cos_sin_cache.dtype
                and positions.dtype == torch.int64 and query.stride(-1) == 1 and key.stride(-1) == 1)


def use_mrope(model: nn.Module, section: tuple[int, ...], interleaved: bool = False) -> None:
    """Qwen2-VL: the model's rotary layers take [3, T] positions (temporal, height, width), the
    rotated pairs split into `section` parts (e.g. 16, 24, 24 of 64), part k turned by the k-th
    positions; [T] positions turn every pair by the one position as before. `interleaved`
    (Qwen3-VL): pair i is turned by the height positions where i % 3 == 1 and i < 3 x section[1],
    the width ones where i % 3 == 2 and i < 3 x section[2], the temporal ones elsewhere."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            pairs = module.cos_sin_cache.shape[-1] // 2
            if sum(section) != pairs or module.interleaved:
                raise ValueError(f"mrope_section={list(section)} must split the {pairs} rotated pairs of a "
                                 "rotate-half rotary layer")
            module.mrope_position_of_pair = (_interleaved_sections(pairs, section) if interleaved else
                                             torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section)))


def _interleaved_sections(pairs: int, section: tuple[int, ...]) -> torch.Tensor:
    pair = torch.arange(pairs)
    which = torch.zeros(pairs, dtype=torch.int64)
    for axis in (1, 2):
        which[(pair % 3 == axis) & (pair < 3 * section[axis])] = axis
    return which


def _rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(first half, second half) -> (-second half, first half): NEOX-style rope's turn."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
