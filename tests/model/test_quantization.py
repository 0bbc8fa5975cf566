"""Online int8 quantization (vllm_lite/model/layers/quantization.py): the int8 linear against the
float product of the same quantized operands, and the engine argument's validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_lite.config import EngineArgs
from vllm_lite.model.layers.linear import RowParallelLinear
from vllm_lite.model.layers.quantization import Int8Weight, int8_linear, quantize_rows


def test_int8_linear_equals_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    x[2] = 0.0  # an all-zero token row stays zero
    bias = torch.randn(48, generator=gen)
    q = Int8Weight.quantize(weight)
    assert q.qweight_t.dtype == torch.int8 and q.qweight_t.shape == (40, 48)
    xq, x_scale = quantize_rows(x)
    expected = (xq.double() * x_scale.double()) @ (q.qweight_t.double() * q.scale.double()) + bias.double()
    out = int8_linear(x, q, bias)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product: per-channel / per-token int8 keeps ~2 digits
    torch.testing.assert_close(out, x @ weight.t() + bias, rtol=0.05, atol=0.15)


def test_layer_quantize_int8_replaces_weight() -> None:
    layer = RowParallelLinear(40, 48)
    layer.weight.data.normal_()
    x = torch.randn(3, 40)
    reference = layer(x)
    layer.quantize_int8()
    layer.process_weights_after_loading()  # packing leaves a quantized layer alone
    assert isinstance(layer.packed_weight, Int8Weight) and layer.weight.device.type == "meta"
    torch.testing.assert_close(layer(x), reference, rtol=0.05, atol=0.15)


@pytest.mark.parametrize("value", ["int4", "fp8", ""])
def test_unknown_quantization_is_refused(tiny_llama: Path, value: str) -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=str(tiny_llama), quantization=value).create_engine_config()
