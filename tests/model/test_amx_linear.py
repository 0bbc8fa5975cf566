"""bf16 linear layers on AMX tiles (csrc/bf16_linear_ops.cpp, model/layers/amx_linear.py): the
decode-sized matmul must equal the fp32 product of the same bf16 values rounded once, for any
row count, ragged K and N, a bias and strided rows; linear() must route by row count; and the
tiles must share oneDNN's memory (no second copy of the weights)."""

from __future__ import annotations

import pytest
import torch

from vllm_lite._custom_ops import amx_bf16_usable
from vllm_lite.model.layers.amx_linear import AMX_MAX_ROWS, AmxWeight, pack_tiles
from vllm_lite.model.layers.linear import RowParallelLinear, linear, prepack
from vllm_lite.model.loader import weight_bytes

pytestmark = pytest.mark.skipif(not amx_bf16_usable(), reason="needs a CPU with AMX-BF16 and the csrc build")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().t()
    return out if bias is None else out + bias.double()


def assert_rounded_once(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one bf16 rounding of the exact sum (plus fp32 summation slack): a second rounding,
    a dropped K block or a wrong column would be many ulps off."""
    ulp = expected.abs().clamp_min(1e-3) * 2.0 ** -8
    error = (out.double() - expected).abs()
    assert bool((error <= ulp * 1.01 + 1e-4).all()), f"max error {float((error - ulp).max()):.4g} over one ulp"


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (70, 100), (1536, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_product_rounded_once(rows: int, in_features: int, out_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    wide = torch.randn(rows, in_features + 8, generator=gen).bfloat16()
    x = wide[:, 3:3 + in_features]  # strided rows: the op copies them into tiles
    out = torch.ops.vllm_lite_C.amx_bf16_linear(x, pack_tiles(weight), out_features, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    assert_rounded_once(out, reference(x, weight, bias))


def test_linear_routes_small_row_counts_to_tiles_and_large_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    packed = prepack(weight)
    assert isinstance(packed, AmxWeight)
    calls: list[int] = []
    op = torch.ops.vllm_lite_C.amx_bf16_linear

    def spy(*args):
        calls.append(args[0].shape[0])
        return op(*args)

    x = torch.randn(2, 3, 64, generator=gen).bfloat16()  # 6 rows, 3-D like a batch of sequences
    monkeypatch.setattr(torch.ops.vllm_lite_C, "amx_bf16_linear", spy)
    small = linear(x, weight, packed)
    large = linear(torch.randn(AMX_MAX_ROWS + 1, 64, generator=gen).bfloat16(), weight, packed)
    assert calls == [6]
    assert small.shape == (2, 3, 96) and large.shape == (AMX_MAX_ROWS + 1, 96)
    assert_rounded_once(small.reshape(6, 96), reference(x.reshape(6, 64), weight, None))


def test_tiles_share_onednn_memory_and_count_once() -> None:
    layer = RowParallelLinear(576, 960, bias=False)
    layer.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    layer.to(torch.bfloat16)
    layer.process_weights_after_loading()
    packed = layer.packed_weight
    assert isinstance(packed, AmxWeight)
    assert packed.tiles.data_ptr() == torch.ops.mkldnn.data_ptr(packed.onednn)
    assert weight_bytes(layer) == 576 * 960 * 2


def test_bad_packing_is_refused_with_its_name() -> None:
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed_weight"):
        torch.ops.vllm_lite_C.amx_bf16_linear(x, torch.zeros(100, dtype=torch.bfloat16), 32, None)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.vllm_lite_C.amx_bf16_linear(x.float(), pack_tiles(torch.zeros(32, 64)), 32, None)
