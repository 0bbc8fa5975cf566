"""AWQ and GPTQ checkpoints (4-bit weights, 8-bit for GPTQ too; activations in the model dtype:
W4A16), read into float weights at load: each linear layer's `qweight` / `qzeros` / `scales`
(/ `g_idx`) become its `weight`, w = (q - z) * s per group of input features, then load as an
unquantized checkpoint's would (fused layers, tensor parallel slicing). The product is exact in
float32 (q - z is a small integer, s an fp16 number), so the model computes with the weights the
checkpoint stands for; memory and speed are those of the unquantized model.

Packing (int32 words, `bits` per value, value k of a word in bits [k*bits, (k+1)*bits)):

| format | qweight | qzeros | scales | zero point |
|---|---|---|---|---|
| AWQ (GEMM) | `[in, out/8]`, along the output in AWQ's order: column j of a word is value REVERSE[j] | `[groups, out/8]`, the same | `[groups, out]` | as stored |
| GPTQ | `[in*bits/32, out]`, along the input in order | `[groups, out*bits/32]`, in order | `[groups, out]` | stored + 1 (`gptq`, AutoGPTQ's v1 format), as stored (`gptq_v2`); 2^(bits-1) when `sym` |

GPTQ's `g_idx` (the group of each input feature; act-order checkpoints permute it) is honoured
as given; without it, groups are consecutive.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Word position of AWQ's output column j (AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7).
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
PARTS = ("qweight", "qzeros", "scales", "g_idx")
Q4_1_BLOCK = 32  # input features per GGUF Q4_1 block


@dataclass(frozen=True, slots=True)
class WNA16Scheme:
    method: str  # awq | gptq
    bits: int
    sym: bool = False  # GPTQ: zero point 2^(bits-1), qzeros not read
    zeros_offset: int = 0  # GPTQ v1: stored zeros are z - 1

    @staticmethod
    def of(config: dict[str, Any]) -> WNA16Scheme:
        """From a quantization_config that config_fields.check_quantization_config accepted."""
        method = config["quant_method"]
        if method == "awq":
            return WNA16Scheme("awq", 4)
        v1 = config.get("checkpoint_format", config.get("format", "gptq")) == "gptq"
        return WNA16Scheme("gptq", config["bits"], sym=bool(config.get("sym", True)), zeros_offset=int(v1))


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their values (int32, 0 .. 2^bits - 1), the words' values side by side along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word] after the packed dim
    if dim == 0:
        return values.permute(0, 2, 1).reshape(packed.shape[0] * per_word, packed.shape[1])
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def dequantize(scheme: WNA16Scheme, parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The float32 `[out, in]` weight of one layer's parts (named in errors by `name`)."""
    q, zeros, scales, groups = _decode(scheme, parts, name)
    weight = (q - zeros[groups]).float() * scales[groups]  # [in, out]
    return weight.t().contiguous()


def q4_1_blocks(scheme: WNA16Scheme, parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """One layer's 4-bit weight as GGUF Q4_1 blocks (uint8 `[out, in / 32 * 20]`, the layout
    layers/gguf_quant.py computes with): per 32 input features, d = s and m = -z * s, so
    w = q * d + m. The values q are the checkpoint's; d is s exactly (fp16 either way); m is
    -z * s rounded to fp16, off by at most 2^-12 of z * s (under 1% of a quantization step).
    Needs consecutive groups (no act-order) of a multiple of 32 features: `fits_q4_1`."""
    q, zeros, scales, groups = _decode(scheme, parts, name)
    in_features, out_features = q.shape
    starts = groups[::Q4_1_BLOCK]  # each 32-feature block lies in one group
    scale = scales[starts].t().half().contiguous()  # [out, blocks]
    minimum = (-(zeros[starts].float() * scales[starts])).t().half().contiguous()
    values = q.t().reshape(out_features, -1, Q4_1_BLOCK).to(torch.uint8)
    nibbles = values[..., :16] | (values[..., 16:] << 4)
    blocks = torch.cat([scale.unsqueeze(-1).view(torch.uint8), minimum.unsqueeze(-1).view(torch.uint8), nibbles],
                       dim=-1)
    return blocks.reshape(out_features, -1).contiguous()


def fits_q4_1(scheme: WNA16Scheme, in_features: int, g_idx: torch.Tensor | None, num_groups: int) -> bool:
    """Whether a layer's weight fits Q4_1 blocks: 4 bits, and every 32-feature block inside one
    group (consecutive groups of a multiple of 32 features)."""
    if scheme.bits != 4 or in_features % Q4_1_BLOCK or in_features % num_groups:
        return False
    group_size = in_features // num_groups
    consecutive = torch.arange(in_features) // group_size
    return group_size % Q4_1_BLOCK == 0 and (g_idx is None or torch.equal(g_idx.long(), consecutive))


def _decode(scheme: WNA16Scheme, parts: dict[str, torch.Tensor], name: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values q `[in, out]`, zero points `[groups, out]`, float32 scales `[groups, out]`, each
    input feature's group `[in]`) of one layer's parts."""
    missing = [part for part in ("qweight", "scales") if part not in parts]
    if missing or (not scheme.sym and "qzeros" not in parts):
        raise ValueError(f"checkpoint: {name} lacks {missing or ['qzeros']} beside its other {scheme.method} tensors")
    scales = parts["scales"].float()
    if scheme.method == "awq":
        order = torch.tensor(AWQ_REVERSE_ORDER)
        q = _awq_columns(unpack(parts["qweight"], 4, 1), order)
        zeros = _awq_columns(unpack(parts["qzeros"], 4, 1), order)
    else:
        q = unpack(parts["qweight"], scheme.bits, 0)
        if scheme.sym:
            zeros = torch.full_like(scales, 1 << (scheme.bits - 1), dtype=torch.int32)
        else:
            zeros = unpack(parts["qzeros"], scheme.bits, 1) + scheme.zeros_offset
    in_features, out_features = q.shape
    groups = _groups(parts.get("g_idx"), in_features, scales.shape[0], name)
    if scales.shape[1] != out_features or zeros.shape[1] < out_features:
        raise ValueError(f"checkpoint: {name} scales / qzeros {tuple(scales.shape)} / {tuple(zeros.shape)} do "
                         f"not fit its {in_features} x {out_features} weight")
    return q, zeros[:, :out_features], scales, groups


def _awq_columns(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    rows, columns = values.shape
    return values.view(rows, columns // 8, 8)[:, :, order].reshape(rows, columns)


def _groups(g_idx: torch.Tensor | None, in_features: int, num_groups: int, name: str) -> torch.Tensor:
    """Each input feature's group: GPTQ's g_idx, else consecutive groups of in / num_groups."""
    if g_idx is not None:
        groups = g_idx.long()
        if groups.shape != (in_features,) or int(groups.min()) < 0 or int(groups.max()) >= num_groups:
            raise ValueError(f"checkpoint: {name}.g_idx must give each of the {in_features} input features a "
                             f"group in [0, {num_groups})")
        return groups
    if in_features % num_groups:
        raise ValueError(f"checkpoint: {name} has {in_features} input features, not a multiple of its "
                         f"{num_groups} groups")
    return torch.arange(in_features) // (in_features // num_groups)


def dequantized_weights(weights: Iterator[tuple[str, Any]], scheme: WNA16Scheme,
                        kept: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each quantized layer's parts replaced by its `weight`: Q4_1
    blocks for the layers (checkpoint prefixes) in `kept`, whose parameters were made block
    parameters beforehand (`keep_quantized`), float for the others. They are yielded once the
    whole checkpoint has been read (a layer's parts may sit in different shards); the other
    tensors pass through as they come."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, weight in weights:
        prefix, _, part = name.rpartition(".")
        if part in PARTS:
            layers.setdefault(prefix, {})[part] = weight if isinstance(weight, torch.Tensor) else weight[:]
        else:
            yield name, weight
    for prefix, parts in layers.items():
        convert = q4_1_blocks if prefix in kept else dequantize
        yield f"{prefix}.weight", convert(scheme, parts, prefix)
    logger.info("%s checkpoint: of %d linear layers' %d-bit weights, %d kept in 4-bit blocks, the others "
                "dequantized at load (memory and speed of the unquantized model)", scheme.method.upper(),
                len(layers), scheme.bits, len(kept & set(layers)))
