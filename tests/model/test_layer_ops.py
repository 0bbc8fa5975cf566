"""The fused csrc decoder-layer ops (RMSNorm with the residual add, rotary embedding, SiLU-and-mul)
against torch references: float32 to ~1e-5, bfloat16 within one bf16 rounding of the same math
done in float64 on the bf16 inputs; and the layer modules' csrc path against their torch path."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from torch_threads import threads
from vllm_lite import _custom_ops as ops
from vllm_lite.model.layers.activation import SiluAndMul
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not ops.is_available(), reason="vllm_lite._C is not built")

# Decode-sized (one thread, no parallel region) and prefill-sized (rows * width >= 2**16:
# chunks across threads) shapes; widths that are not a multiple of 16 exercise the scalar tails.
ROWS = (1, 7, 33, 200)
EPS = 1e-6
BF16_RTOL = 2.0 ** -8  # one rounding to bf16 is at most 2**-9 relative; the rest is fp32 noise


def _close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(actual.double(), expected64, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual.double(), expected64, rtol=BF16_RTOL, atol=1e-6)


def _rms_norm64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 576, 2048])
def test_rms_norm(dtype, width):
    gen = torch.Generator().manual_seed(width)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    for rows in ROWS:
        x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
        out = torch.empty_like(x)
        with threads(2):
            ops.rms_norm(out, x, weight, EPS)
        _close(out, _rms_norm64(x, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_strided_rows(dtype):
    """Rows of a wider tensor (a view with a row stride), as a q/k slice of a fused output."""
    wide = torch.randn(9, 100, dtype=dtype)
    x = wide[:, 10:74]
    weight = torch.rand(64, dtype=dtype) + 0.5
    out = torch.empty(x.shape, dtype=dtype)
    ops.rms_norm(out, x, weight, EPS)
    _close(out, _rms_norm64(x, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 576])
def test_fused_add_rms_norm(dtype, width):
    gen = torch.Generator().manual_seed(width + 1)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    for rows in ROWS:
        x = torch.randn(rows, width, generator=gen).to(dtype)
        residual = (4 * torch.randn(rows, width, generator=gen)).to(dtype)
        added = x + residual  # torch's own rounding of the sum: the op must store exactly this
        with threads(2):
            ops.fused_add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(residual, added)
        _close(x, _rms_norm64(added, weight), dtype)


def _rotary64(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    half = cos_sin.shape[1] // 2
    cos = cos_sin[positions, :half].double()[:, None, :]
    sin = cos_sin[positions, half:].double()[:, None, :]
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [36, 64])
def test_rotary_embedding_in_place_on_qkv_views(dtype, head_dim):
    """q and k as the layer makes them: strided views into one fused qkv output; v untouched."""
    num_heads, num_kv_heads, max_position = 9, 3, 600
    gen = torch.Generator().manual_seed(head_dim)
    angles = torch.rand(max_position, head_dim // 2, generator=gen) * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1).to(dtype)
    for tokens in ROWS:
        qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, num_heads, head_dim)
        k = k.view(tokens, num_kv_heads, head_dim)
        positions = torch.randint(0, max_position, (tokens,), generator=gen)
        expected_q, expected_k, v_before = _rotary64(q, positions, cos_sin), _rotary64(k, positions, cos_sin), v.clone()
        with threads(2):
            ops.rotary_embedding(positions, q, k, cos_sin)
        _close(q, expected_q, dtype)
        _close(k, expected_k, dtype)
        assert torch.equal(v, v_before)


def test_rotary_embedding_rejects_a_position_outside_the_cache():
    cos_sin = torch.zeros(8, 16)
    q, k = torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match=r"positions\[1\]=8 is outside"):
        ops.rotary_embedding(torch.tensor([0, 8]), q, k, cos_sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [24, 1536])
def test_silu_and_mul(dtype, d):
    gen = torch.Generator().manual_seed(d)
    for rows in ROWS:
        x = (4 * torch.randn(rows, 2 * d, generator=gen)).to(dtype)
        x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped range and zero
        out = torch.empty(rows, d, dtype=dtype)
        with threads(2):
            ops.silu_and_mul(out, x)
        gate, up = x.double().chunk(2, dim=-1)
        _close(out, F.silu(gate) * up, dtype)


def test_ops_refuse_mixed_dtypes():
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="x and weight must have the same dtype"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(32, dtype=torch.bfloat16), EPS)
    with pytest.raises(RuntimeError, match="x and out must have the same dtype"):
        ops.silu_and_mul(torch.empty(4, 16, dtype=torch.bfloat16), x)


# ---- the layer modules: csrc path against their torch path ----

@contextlib.contextmanager
def torch_path(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(ops, "takes_layer_ops", lambda x: False)
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_match_their_torch_path(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, EPS).to(dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    rotary = RotaryEmbedding(32, 128, 10000.0, None).to(dtype)
    hidden, residual = torch.randn(5, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
    gate_up = torch.randn(5, 96, generator=gen).to(dtype)
    q, k = torch.randn(5, 2, 32, generator=gen).to(dtype), torch.randn(5, 1, 32, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 17, 64, 127])
    with torch_path(monkeypatch):
        ref_norm = norm(hidden.clone())
        ref_added, ref_residual = norm(hidden.clone(), residual.clone())
        ref_act = SiluAndMul()(gate_up)
        ref_q, ref_k = rotary(positions, q.clone(), k.clone())
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 * BF16_RTOL, "atol": 3e-2}
    torch.testing.assert_close(norm(hidden.clone()), ref_norm, **tol)
    added, new_residual = norm(hidden.clone(), residual.clone())
    torch.testing.assert_close(added, ref_added, **tol)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(SiluAndMul()(gate_up), ref_act, **tol)
    new_q, new_k = rotary(positions, q.clone(), k.clone())
    torch.testing.assert_close(new_q, ref_q, **tol)
    torch.testing.assert_close(new_k, ref_k, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_turns_the_first_dimensions_only(monkeypatch, dtype):
    """A rotary layer made for 8 of 32 dimensions (GPT-NeoX's rotary_pct 0.25): the csrc op on
    the views and the torch path agree, the first 8 dimensions are those of an 8-wide head, the
    other 24 pass unchanged."""
    gen = torch.Generator().manual_seed(1)
    partial, full_width = RotaryEmbedding(8, 128, 10000.0, None).to(dtype), 32
    qkv = torch.randn(5, 3 * full_width, generator=gen).to(dtype)
    q, k = qkv[:, :full_width].view(5, 1, full_width), qkv[:, full_width:2 * full_width].view(5, 1, full_width)
    positions = torch.tensor([0, 3, 17, 64, 127])
    with torch_path(monkeypatch):
        ref_q, ref_k = partial(positions, q.clone(), k.clone())
        narrow_q, _ = partial(positions, q[..., :8].clone(), k[..., :8].clone())
    torch.testing.assert_close(ref_q[..., :8], narrow_q)
    assert torch.equal(ref_q[..., 8:], q[..., 8:]) and torch.equal(ref_k[..., 8:], k[..., 8:])
    assert not torch.equal(ref_q[1:, :, :8], q[1:, :, :8])  # (position 0 turns nothing)
    new_q, new_k = partial(positions, q, k)  # in place on the views where the op takes them
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 * BF16_RTOL, "atol": 3e-2}
    torch.testing.assert_close(new_q, ref_q, **tol)
    torch.testing.assert_close(new_k, ref_k, **tol)
