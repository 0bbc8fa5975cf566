"""FP8 checkpoints (quant_method "fp8", and compressed-tensors' float-quantized format), read into
float weights at load: each linear layer's e4m3 `weight` times its scale, w = q * s, with the
scale per tensor, per output channel, or per block of the weight (`weight_scale`, or the
`weight_scale_inv` blocks of DeepSeek's and Qwen's FP8 releases, multiplied despite the name).
The product is exact in float32, so the model computes with the weights the checkpoint stands
for; activations stay in the model dtype whatever the activation scheme (vLLM's weight-only FP8
on hardware without FP8 matmuls), so an `input_scale` is not read. Memory and speed are those of
the unquantized model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCALE_PARTS = ("weight_scale", "weight_scale_inv")
FP8_DTYPES = (torch.float8_e4m3fn, "F8_E4M3")


@dataclass(frozen=True, slots=True)
class FP8Scheme:
    block: tuple[int, int] | None  # (rows, columns) of a weight block sharing one scale

    @staticmethod
    def of(config: dict[str, Any]) -> FP8Scheme:
        """From a quantization_config that config_fields.check_quantization_config accepted."""
        if config["quant_method"] == "fp8":
            block = config.get("weight_block_size")
        else:
            group = next(iter(config["config_groups"].values()))
            block = group["weights"].get("block_structure")
        return FP8Scheme(tuple(block) if block is not None else None)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   name: str) -> torch.Tensor:
    """The float32 `[out, in]` weight of an e4m3 weight and its scale."""
    out_features, in_features = weight.shape
    scale = scale.float()
    if scale.numel() == 1:
        scale = scale.reshape(1, 1)
    elif scale.numel() == out_features and scale.shape[0] == out_features:
        scale = scale.reshape(out_features, 1)
    elif block is not None and tuple(scale.shape) == (-(-out_features // block[0]), -(-in_features // block[1])):
        scale = scale.repeat_interleave(block[0], 0)[:out_features].repeat_interleave(block[1], 1)[:, :in_features]
    else:
        raise ValueError(f"checkpoint: {name}'s scale {tuple(scale.shape)} is neither one per tensor, per output "
                         f"channel, nor per {block} block of its {out_features} x {in_features} weight")
    return weight.float() * scale


def dequantized_fp8_weights(weights: Iterator[tuple[str, Any]], scheme: FP8Scheme) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each e4m3 weight and its scale replaced by the float weight,
    yielded once the whole checkpoint has been read; `input_scale`s are dropped (see above)."""
    quantized: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, weight in weights:
        prefix, _, part = name.rpartition(".")
        if part == "weight" and _dtype(weight) in FP8_DTYPES:
            quantized[prefix] = weight if isinstance(weight, torch.Tensor) else weight[:]
        elif part in SCALE_PARTS:
            scales[prefix] = weight if isinstance(weight, torch.Tensor) else weight[:]
        elif part != "input_scale":
            yield name, weight
    orphans = sorted(set(scales) - set(quantized))
    if orphans:
        raise ValueError(f"checkpoint: {orphans[0]} has a weight scale but no fp8 weight")
    for prefix, weight in quantized.items():
        if prefix not in scales:
            raise ValueError(f"checkpoint: {prefix}.weight is fp8 without a weight_scale")
        yield f"{prefix}.weight", dequantize_fp8(weight, scales[prefix], scheme.block, prefix)
    logger.info("FP8 checkpoint: %d linear layers' e4m3 weights dequantized at load (activations in the model "
                "dtype; memory and speed of the unquantized model)", len(quantized))


def _dtype(weight: Any) -> Any:
    return weight.dtype if isinstance(weight, torch.Tensor) else weight.get_dtype()
