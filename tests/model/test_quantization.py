"""Online int8 quantization (vllm_lite/model/layers/quantization.py): the int8 linear against the
float product of the same quantized operands, the csrc ends of the int8 linear against the torch
rule, and the engine argument's validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torch_threads import threads
from vllm_lite import _custom_ops as ops
from vllm_lite.config import EngineArgs
from vllm_lite.model.layers.fused_moe import FusedMoE, route
from vllm_lite.model.layers.linear import RowParallelLinear
from vllm_lite.model.layers.quantization import (Int8Weight, int8_linear, pack_int8_tiles, quantize_rows,
                                                  unpack_int8_tiles)


def test_int8_linear_equals_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    x[2] = 0.0  # an all-zero token row stays zero
    bias = torch.randn(48, generator=gen)
    q = Int8Weight.quantize(weight)
    assert q.values().dtype == torch.int8 and q.values().shape == (48, 40)
    assert (q.tiles is None) != (q.qweight_t is None)  # (one copy: AMX tiles where the CPU has AMX-INT8)
    xq, x_scale = quantize_rows(x)
    expected = (xq.double() * x_scale.double()) @ (q.values().t().double() * q.scale.double()) + bias.double()
    out = int8_linear(x, q, bias)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product: per-channel / per-token int8 keeps ~2 digits
    torch.testing.assert_close(out, x @ weight.t() + bias, rtol=0.05, atol=0.15)


@pytest.mark.parametrize("rows, cols", [(48, 40), (100, 70), (32, 64), (1, 130)])
def test_int8_tiles_pack_and_unpack(rows: int, cols: int) -> None:
    """AMX-INT8's B-tile layout: [N/32][K/64][16 k-quads][32 n][4 k], zero-padded; unpacked exactly."""
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    tiles = pack_int8_tiles(q)
    assert tiles.numel() == -(-rows // 32) * 32 * -(-cols // 64) * 64
    assert torch.equal(unpack_int8_tiles(tiles, rows, cols), q)
    # the first block's first tile row: the first 16 output rows' k 0-3, then rows 16-31's
    assert torch.equal(tiles[:64].view(16, 4), torch.nn.functional.pad(q[:16, :4], (0, 0, 0, 16 - min(rows, 16)))[:16])


@pytest.mark.skipif(not ops.amx_int8_usable(), reason="needs AMX-INT8 and the csrc build")
@pytest.mark.parametrize("out_features, in_features", [(100, 70), (960, 576), (33, 130), (64, 64)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64, 300, 600])
def test_amx_int8_mm_gives_int_mm_sums(out_features: int, in_features: int, rows: int) -> None:
    """The AMX-INT8 tiles' int32 sums equal torch._int_mm's exactly (ragged rows, K and N tails,
    one and two row tiles, several row blocks, strided rows of x, x copied into tiles by threads
    at 600 x 576)."""
    gen = torch.Generator().manual_seed(rows + out_features)
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    wide = torch.randint(-127, 128, (rows, in_features + 8), dtype=torch.int8, generator=gen)
    x = wide[:, 3:3 + in_features]
    with threads(2):
        got = ops.amx_int8_mm(x, pack_int8_tiles(q), out_features)
    assert torch.equal(got, torch._int_mm(x.contiguous(), q.t()))


@pytest.mark.skipif(not ops.amx_int8_usable(), reason="needs AMX-INT8 and the csrc build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 100, 70), (17, 960, 576), (40, 33, 130),
                                                             (600, 64, 576)])
def test_amx_int8_linear_equals_the_three_ops(dtype: torch.dtype, with_bias: bool, rows: int, out_features: int,
                                              in_features: int) -> None:
    """The fused op gives the values of quantize_rows_int8, amx_int8_mm and dequantize_int32 in
    turn, bit for bit (ragged rows, K and N; strided rows of x; an all-zero row; x quantized into
    tiles by threads at 600 x 576)."""
    gen = torch.Generator().manual_seed(rows + in_features)
    q = Int8Weight.quantize(torch.randn(out_features, in_features, generator=gen))
    wide = (torch.randn(rows, in_features + 8, generator=gen) * 3).to(dtype)
    x = wide[:, 5:5 + in_features]
    x[rows // 2] = 0.0
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    with threads(2):
        fused = ops.amx_int8_linear(x, q.tiles, q.scale, bias)
        xq, x_scale = ops.quantize_rows_int8(x)
        acc = ops.amx_int8_mm(xq, q.tiles, out_features)
        expected = ops.dequantize_int32(acc, x_scale, q.scale, bias, dtype)
    assert fused.dtype == dtype and fused.shape == (rows, out_features)
    assert torch.equal(fused, expected)


@pytest.mark.skipif(not ops.amx_int8_usable(), reason="needs AMX-INT8 and the csrc build")
def test_amx_int8_linear_refuses_a_bias_of_another_dtype() -> None:
    q = Int8Weight.quantize(torch.ones(32, 64))
    with pytest.raises(RuntimeError, match="amx_int8_linear: bias must be contiguous, of x's dtype"):
        ops.amx_int8_linear(torch.ones(2, 64).bfloat16(), q.tiles, q.scale, torch.zeros(32))


def test_layer_quantize_int8_replaces_weight() -> None:
    gen = torch.Generator().manual_seed(0)  # the tolerance holds for typical draws, not every one
    layer = RowParallelLinear(40, 48)
    layer.weight.data.normal_(generator=gen)
    x = torch.randn(3, 40, generator=gen)
    reference = layer(x)
    layer.quantize_int8()
    layer.process_weights_after_loading()  # packing leaves a quantized layer alone
    assert isinstance(layer.packed_weight, Int8Weight) and layer.weight.device.type == "meta"
    torch.testing.assert_close(layer(x), reference, rtol=0.05, atol=0.15)


def test_int8_experts_are_each_experts_int8_layers_and_the_router_stays_float() -> None:
    """quantization="int8" on an MoE layer: each expert's gate_up and down projections become int8
    layers, each token's output the router-weighted sum of its experts' int8 layers (computed
    here token by token); the router is not quantized (vLLM's rule), so tokens keep their experts."""
    gen = torch.Generator().manual_seed(0)
    moe = FusedMoE(num_experts=4, top_k=2, hidden_size=40, intermediate_size=24, renormalize=True)
    for param in (moe.gate.weight, moe.w13, moe.w2):
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    x = torch.randn(7, 40, generator=gen)
    x[3] = 0.0
    float_out = moe(x)
    w13, w2, router = moe.w13.detach().clone(), moe.w2.detach().clone(), moe.gate.weight.detach().clone()
    moe.quantize_int8()
    moe.gate.quantize_int8()  # (the loader asks every layer)
    assert moe.w13.is_meta and moe.w2.is_meta and moe.gate.packed_weight is None
    assert torch.equal(moe.gate.weight, router)
    out = moe(x)
    weights, experts = route(x @ router.t(), 2, True)
    expected = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], experts[token].tolist()):
            gate, up = int8_linear(x[token:token + 1], Int8Weight.quantize(w13[expert])).chunk(2, dim=-1)
            down = int8_linear(torch.nn.functional.silu(gate) * up, Int8Weight.quantize(w2[expert]))
            expected[token] += weight * down[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not out[3].any()
    torch.testing.assert_close(out, float_out, rtol=0.1, atol=0.05)


@pytest.mark.parametrize("value", ["int4", "fp8", ""])
def test_unknown_quantization_is_refused(tiny_llama: Path, value: str) -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=str(tiny_llama), quantization=value).create_engine_config()


needs_csrc = pytest.mark.skipif(not ops.is_available(), reason="vllm_lite._C is not built")


@needs_csrc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 7), (5, 40), (33, 576), (200, 333)])  # tails, and >= 2**16 values: threads
def test_csrc_quantize_rows_equals_torch_rule(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
    x[0, : min(3, width)] = 0.0
    if rows > 2:
        x[2] = 0.0  # an all-zero row: scale 1e-12, zeros
    x[-1, -1] = 2.5  # ties round to even
    with threads(2):
        q, scale = ops.quantize_rows_int8(x)
    expected_q, expected_scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (rows, 1)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q, expected_q)


@needs_csrc
def test_csrc_quantize_rows_takes_strided_rows() -> None:
    x = torch.randn(6, 64)
    q, scale = ops.quantize_rows_int8(x[:, :40])
    expected_q, expected_scale = quantize_rows(x[:, :40].contiguous())
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@needs_csrc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, width", [(3, 40), (64, 1030)])  # 64 x 1030 >= 2**16: threads
def test_csrc_dequantize_int32(dtype: torch.dtype, with_bias: bool, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    acc = torch.randint(-2**20, 2**20, (rows, width), generator=gen, dtype=torch.int32)
    row_scale = torch.rand(rows, 1, generator=gen) / 100
    col_scale = torch.rand(width, generator=gen) / 100
    bias = torch.randn(width, generator=gen).to(dtype) if with_bias else None
    with threads(2):
        out = ops.dequantize_int32(acc, row_scale, col_scale, bias, dtype)
    expected = acc.double() * row_scale.double() * col_scale.double()
    if bias is not None:
        expected = expected + bias.double()
    assert out.dtype == dtype and out.shape == (rows, width)
    rtol = 1e-6 if dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-6)


@needs_csrc
def test_int8_linear_fused_path_equals_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(2, 9, 64, generator=gen)
    q = Int8Weight.quantize(weight)
    fused = int8_linear(x, q, bias)
    monkeypatch.setattr(ops, "takes_layer_ops", lambda t: False)
    reference = int8_linear(x, q, bias)
    assert fused.shape == (2, 9, 96)
    assert torch.equal(fused, reference)  # fp32: the same roundings (product, then bias)
