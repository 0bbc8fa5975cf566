"""AWQ, GPTQ and compressed-tensors' pack-quantized checkpoints (4- or 8-bit integer weights in
groups, activations in the model dtype: W4A16 / W8A16), read at load: each linear layer's packed
values, zero points, scales (and group index) become its `weight`, w = (q - z) * s per group of
input features, then load as an unquantized checkpoint's would (fused layers, tensor parallel
slicing). The product is exact in float32 (q - z is a small integer, s an fp16 or bf16 number), so
the model computes with the weights the checkpoint stands for. Layers that fit stay 4-bit in GGUF
Q4_1 blocks instead (`q4_1_blocks`; model/loader.py decides).

Packing (int32 words, `bits` per value, value k of a word in bits [k*bits, (k+1)*bits)):

| format | values | zero points | scales | zero point z |
|---|---|---|---|---|
| AWQ (GEMM) | `qweight [in, out/8]`, along the output in AWQ's order: column j of a word is value REVERSE[j] | `qzeros [groups, out/8]`, the same | `scales [groups, out]` | as stored |
| GPTQ | `qweight [in*bits/32, out]`, along the input in order | `qzeros [groups, out*bits/32]`, in order | `scales [groups, out]` | stored + 1 (`gptq`, AutoGPTQ's v1 format), as stored (`gptq_v2`); 2^(bits-1) when `sym` |
| compressed-tensors pack-quantized | `weight_packed [out, in*bits/32]`, along the input in order (`weight_shape`: the unpadded shape) | `weight_zero_point [out*bits/32, groups]`, along the output | `weight_scale [out, groups]` | as stored; 2^(bits-1) when symmetric |

Values and zero points are read as stored (unsigned): compressed-tensors stores a signed value v as
v + 2^(bits-1), which cancels in q - z. The group of each input feature is the checkpoint's
`g_idx` / `weight_g_idx` where there is one (act-order checkpoints permute it); else groups are
consecutive.
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
# Each format's tensor names for the parts of a layer: its values, zero points, scales, group of
# each input feature, unpadded shape.
PART_NAMES: dict[str, dict[str, str]] = {
    "awq": {"qweight": "values", "qzeros": "zeros", "scales": "scales"},
    "gptq": {"qweight": "values", "qzeros": "zeros", "scales": "scales", "g_idx": "g_idx"},
    "compressed-tensors": {"weight_packed": "values", "weight_zero_point": "zeros", "weight_scale": "scales",
                           "weight_g_idx": "g_idx", "weight_shape": "shape"},
}
Q4_1_BLOCK = 32  # input features per GGUF Q4_1 block


@dataclass(frozen=True, slots=True)
class WNA16Scheme:
    method: str  # awq | gptq | compressed-tensors
    bits: int
    sym: bool = False  # zero point 2^(bits-1), no zero points stored
    zeros_offset: int = 0  # GPTQ v1: stored zeros are z - 1

    @staticmethod
    def of(config: dict[str, Any]) -> WNA16Scheme:
        """From a quantization_config that config_fields.check_quantization_config accepted."""
        method = config["quant_method"]
        if method == "awq":
            return WNA16Scheme("awq", 4)
        if method == "compressed-tensors":
            weights = next(iter(config["config_groups"].values()))["weights"]
            return WNA16Scheme(method, weights["num_bits"], sym=bool(weights.get("symmetric", True)))
        v1 = config.get("checkpoint_format", config.get("format", "gptq")) == "gptq"
        return WNA16Scheme("gptq", config["bits"], sym=bool(config.get("sym", True)), zeros_offset=int(v1))

    @property
    def parts(self) -> dict[str, str]:
        return PART_NAMES[self.method]

    def layer_shape(self, values_shape: tuple[int, int]) -> tuple[int, int]:
        """(in, out) features of a layer from its packed values' shape."""
        rows, columns = values_shape
        per_word = 32 // self.bits
        if self.method == "awq":
            return rows, columns * per_word
        if self.method == "gptq":
            return rows * per_word, columns
        return columns * per_word, rows

    def num_groups(self, scales_shape: tuple[int, int]) -> int:
        return scales_shape[1] if self.method == "compressed-tensors" else scales_shape[0]


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
    input feature's group `[in]`) of one layer's parts (keyed by role: values, zeros, ...)."""
    missing = [role for role in ("values", "scales") if role not in parts]
    if not scheme.sym and "zeros" not in parts:
        missing.append("zeros")
    if missing:
        names = {role: part for part, role in scheme.parts.items()}
        raise ValueError(f"checkpoint: {name} lacks {[names[role] for role in missing]} beside its other "
                         f"{scheme.method} tensors")
    if scheme.method == "awq":
        order = torch.tensor(AWQ_REVERSE_ORDER)
        q = _awq_columns(unpack(parts["values"], 4, 1), order)
        zeros = _awq_columns(unpack(parts["zeros"], 4, 1), order)
        scales = parts["scales"].float()
    elif scheme.method == "gptq":
        q = unpack(parts["values"], scheme.bits, 0)
        scales = parts["scales"].float()
        zeros = None if scheme.sym else unpack(parts["zeros"], scheme.bits, 1) + scheme.zeros_offset
    else:
        q = unpack(parts["values"], scheme.bits, 1)  # [out, padded in]
        out_features, in_features = parts["shape"].tolist() if "shape" in parts else q.shape
        q = q[:out_features, :in_features].t()
        scales = parts["scales"].float().t()
        zeros = None if scheme.sym else unpack(parts["zeros"], scheme.bits, 0)[:out_features].t()
    if zeros is None:
        zeros = torch.full_like(scales, 1 << (scheme.bits - 1), dtype=torch.int32)
    in_features, out_features = q.shape
    groups = _groups(parts.get("g_idx"), in_features, scales.shape[0], name)
    if scales.shape[1] != out_features or zeros.shape[1] < out_features:
        raise ValueError(f"checkpoint: {name} scales / zero points {tuple(scales.shape)} / {tuple(zeros.shape)} "
                         f"do not fit its {in_features} x {out_features} weight")
    return q, zeros[:, :out_features], scales, groups


def _awq_columns(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    rows, columns = values.shape
    return values.view(rows, columns // 8, 8)[:, :, order].reshape(rows, columns)


def _groups(g_idx: torch.Tensor | None, in_features: int, num_groups: int, name: str) -> torch.Tensor:
    """Each input feature's group: the checkpoint's g_idx, else consecutive groups of in / num_groups."""
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
    roles = scheme.parts
    for name, weight in weights:
        prefix, _, part = name.rpartition(".")
        if part in roles:
            layers.setdefault(prefix, {})[roles[part]] = weight if isinstance(weight, torch.Tensor) else weight[:]
        else:
            yield name, weight
    for prefix, parts in layers.items():
        convert = q4_1_blocks if prefix in kept else dequantize
        yield f"{prefix}.weight", convert(scheme, parts, prefix)
    logger.info("%s checkpoint: of %d linear layers' %d-bit weights, %d kept in 4-bit blocks, the others "
                "dequantized at load (memory and speed of the unquantized model)", scheme.method.upper(),
                len(layers), scheme.bits, len(kept & set(layers)))
