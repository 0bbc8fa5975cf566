"""Row-count buckets for oneDNN's CPU matmuls (vllm_lite/model/layers/matmul_rows.py), the fix for
issue 12's finding 11: the engine core's memory grew with every new token count, one cached
oneDNN kernel per shape. The buckets bound the shapes; padding must not change any row's result."""

from __future__ import annotations

import pytest
import torch

from vllm_lite.model.layers.linear import RowParallelLinear, onednn_packs_bf16
from vllm_lite.model.layers.matmul_rows import EXACT_ROWS, bucket_rows, matmul_bucketed
from vllm_lite.model.layers.quantization import Int8Weight, int8_linear

# oneDNN's and ideep's kernel caches each keep 1,024 shapes; a decoder has about 5 linear shapes.
KERNEL_CACHE_CAPACITY = 1024
LINEAR_SHAPES_PER_MODEL = 6


def test_buckets_are_few_and_tight() -> None:
    largest = 8192  # four times the default step budget (max_num_batched_tokens 2,048)
    buckets = [bucket_rows(rows) for rows in range(1, largest + 1)]
    assert buckets[:EXACT_ROWS - 1] == list(range(1, EXACT_ROWS))
    for rows, padded in enumerate(buckets, start=1):
        assert rows <= padded <= rows + rows // 16, (rows, padded)
        assert bucket_rows(padded) == padded
    assert buckets == sorted(buckets)
    assert len(set(buckets)) * LINEAR_SHAPES_PER_MODEL < KERNEL_CACHE_CAPACITY


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 31, 33, 100, 257])
def test_packed_linear_rows_unchanged_by_padding(dtype: torch.dtype, rows: int) -> None:
    layer = RowParallelLinear(64, 48, bias=True)
    gen = torch.Generator().manual_seed(rows)
    layer.weight.data.normal_(generator=gen)
    layer.bias.data.normal_(generator=gen)
    layer.to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.process_weights_after_loading()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    # A CPU on which oneDNN cannot pack bf16 (no AVX-512 BW/VL/DQ) keeps the row-major weight.
    assert (layer.packed_weight is not None) == (dtype == torch.float32 or onednn_packs_bf16())
    out = layer(x)
    assert out.shape == (rows, 48) and out.is_contiguous()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), reference.float(), rtol=tolerance, atol=tolerance)


def test_matmul_sees_bucketed_rows_only() -> None:
    seen: list[int] = []

    def matmul(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows * 2

    x = torch.arange(41 * 3, dtype=torch.float32).reshape(41, 3)
    out = matmul_bucketed(x, matmul)
    assert seen == [bucket_rows(41)] and seen[0] > 41
    torch.testing.assert_close(out, x * 2)


def test_int8_linear_pads_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    q = Int8Weight.quantize(torch.randn(48, 40, generator=gen))
    x = torch.randn(45, 40, generator=gen)
    whole = int8_linear(x, q)
    one_by_one = torch.cat([int8_linear(x[i:i + 1], q) for i in range(45)])
    torch.testing.assert_close(whole, one_by_one)
