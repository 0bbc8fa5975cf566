"""GGUF weights kept in their Q4_1 / Q8_0 blocks (quantization="gguf", implied by a llama .gguf).

Kernels: the csrc GEMM and dequantization (and the torch fallback) against a numpy reference
written from llama.cpp's block layouts, on random blocks and odd shapes. Model path: a tiny Llama
exported as GGUF Q8_0 / Q4_1 runs with its blocks kept, against the same file loaded dequantized
(its converted fp32 folder): the weights are the same numbers, only the summation order differs
(fp32 accumulation either way), so greedy tokens must be equal and teacher-forced logprobs agree
to 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_export import export_gguf
from hf_reference import build_tiny_model
from llm_factory import make_llm
from test_reduced_precision import greedy, teacher_forced_logprobs
from vllm_lite import _custom_ops as ops
from vllm_lite.config import EngineArgs
from vllm_lite.model.layers import gguf_quant
from vllm_lite.model.layers.gguf_quant import GGML_TYPE_Q4_1, GGML_TYPE_Q8_0, GGUFWeight

pytest.importorskip("gguf")

QTYPES = {"Q4_1": GGML_TYPE_Q4_1, "Q8_0": GGML_TYPE_Q8_0}
needs_csrc = pytest.mark.skipif(not ops.is_available(), reason="csrc ops not built")


def random_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 32 * block bytes] of random blocks with finite fp16 scales/mins."""
    blocks = cols // 32
    scales = rng.uniform(-0.05, 0.05, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype == GGML_TYPE_Q8_0:
        values = rng.integers(-128, 128, (rows, blocks, 32)).astype(np.int8).view(np.uint8)
        return np.concatenate([scales, values], axis=-1).reshape(rows, -1)
    mins = rng.uniform(-0.5, 0.5, (rows, blocks, 1)).astype(np.float16).view(np.uint8)
    nibbles = rng.integers(0, 256, (rows, blocks, 16)).astype(np.uint8)
    return np.concatenate([scales, mins, nibbles], axis=-1).reshape(rows, -1)


def reference_dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    """llama.cpp's dequantize_row_q8_0 / dequantize_row_q4_1, block by block, in float32."""
    rows = raw.shape[0]
    out = []
    for row in raw:
        values = []
        for block in row.reshape(-1, 34 if qtype == GGML_TYPE_Q8_0 else 20):
            d = np.float32(block[0:2].view(np.float16)[0])
            if qtype == GGML_TYPE_Q8_0:
                values.append(d * block[2:].view(np.int8).astype(np.float32))
                continue
            m = np.float32(block[2:4].view(np.float16)[0])
            qs = block[4:]
            q = np.concatenate([qs & 15, qs >> 4]).astype(np.float32)
            values.append(d * q + m)
        out.append(np.concatenate(values))
    return np.stack(out).reshape(rows, -1)


@pytest.mark.parametrize("qname", list(QTYPES))
@pytest.mark.parametrize("rows,cols", [(1, 32), (37, 96), (130, 160)])
def test_dequantize_matches_reference(qname: str, rows: int, cols: int) -> None:
    import gguf

    qtype = QTYPES[qname]
    raw = random_blocks(np.random.default_rng(rows * cols), qtype, rows, cols)
    expected = reference_dequantize(raw, qtype)
    # gguf-py (the GGUF format's own Python package) agrees with the reference.
    np.testing.assert_allclose(gguf.quants.dequantize(raw, qtype).reshape(rows, cols), expected, rtol=1e-6, atol=1e-7)
    torch_out = gguf_quant.dequantize_torch(torch.from_numpy(raw), qtype).numpy()
    np.testing.assert_allclose(torch_out, expected, rtol=1e-6, atol=1e-7)
    if ops.is_available():  # a fused multiply-add may round d * q + m once instead of twice
        np.testing.assert_allclose(ops.gguf_dequantize(torch.from_numpy(raw), qtype).numpy(), expected,
                                   rtol=1e-6, atol=1e-7)


@needs_csrc
@pytest.mark.parametrize("qname", list(QTYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16])
@pytest.mark.parametrize("n,k", [(1, 32), (37, 96), (67, 544)])
def test_gemm_matches_reference(qname: str, m: int, n: int, k: int) -> None:
    qtype = QTYPES[qname]
    rng = np.random.default_rng(m * 1000 + n + k)
    raw = random_blocks(rng, qtype, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    expected = x.astype(np.float64) @ reference_dequantize(raw, qtype).astype(np.float64).T
    out = ops.gguf_gemm(torch.from_numpy(x), torch.from_numpy(raw), qtype).numpy()
    assert out.shape == (m, n)
    scale = np.abs(x).sum(axis=1, keepdims=True) * 0.6  # bounds |x| . |w| for these scales
    np.testing.assert_array_less(np.abs(out - expected), np.broadcast_to(1e-5 * scale + 1e-6, out.shape))


@pytest.mark.parametrize("qname", list(QTYPES))
@pytest.mark.parametrize("m", [1, 5, gguf_quant.GEMM_MAX_ROWS + 3])
def test_gguf_linear_both_paths_with_bias(qname: str, m: int) -> None:
    """Decode-sized batches take the kernel, larger ones dequantize and matmul; both equal x @ W.T
    + b in the input's dtype (here a [2, m / 2 ...] batch shape is kept)."""
    qtype = QTYPES[qname]
    rng = np.random.default_rng(m)
    raw = random_blocks(rng, qtype, 40, 64)
    weight = GGUFWeight(torch.from_numpy(raw), qtype, 64)
    x = torch.from_numpy(rng.standard_normal((m, 64)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(40).astype(np.float32))
    expected = x @ torch.from_numpy(reference_dequantize(raw, qtype)).T + bias
    out = gguf_quant.gguf_linear(x.view(1, m, 64), weight, bias)
    assert out.shape == (1, m, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
    bf16 = gguf_quant.gguf_linear(x.to(torch.bfloat16), weight)
    assert bf16.dtype == torch.bfloat16


@needs_csrc
def test_kernel_refuses_bad_input() -> None:
    raw = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.gguf_gemm(torch.zeros(1, 32), raw, 2)
    with pytest.raises(RuntimeError, match="K=64"):
        ops.gguf_gemm(torch.zeros(1, 64), raw, GGML_TYPE_Q4_1)
    with pytest.raises(RuntimeError, match="whole number"):
        ops.gguf_dequantize(torch.zeros(4, 21, dtype=torch.uint8), GGML_TYPE_Q4_1)


# --------------------------------------------------------------------------- #
# A tiny Llama saved as GGUF, run with its blocks kept
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny_llama_32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and GQA; every matrix row a whole number of 32-value blocks."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_32"), "llama", tie_word_embeddings=True,
                            num_heads=4, num_kv_heads=2, hidden_size=64, seed=3)


@pytest.mark.parametrize("quant, fixture, arch", [
    ("Q8_0", "tiny_llama_32", "llama"), ("Q4_1", "tiny_llama_32", "llama"),
    # Qwen files: not permuted, q/k/v biases (Qwen2), q/k norms and a wider head (Qwen3)
    ("Q4_1", "tiny_qwen2", "qwen2"), ("Q8_0", "tiny_qwen3", "qwen3"),
])
def test_kept_quantized_matches_dequantized(quant: str, fixture: str, arch: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                                            prompts_token_ids: list[list[int]]) -> None:
    from vllm_lite.gguf_convert import gguf_model_dir

    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    source: Path = request.getfixturevalue(fixture)
    gguf_file = export_gguf(source, tmp_path / f"tiny-{arch}-{quant}.gguf", arch, quant=quant)
    assert EngineArgs(model=str(gguf_file)).create_engine_config().model_config.quantization == "gguf"
    kept = make_llm(gguf_file)
    dequantized = make_llm(gguf_model_dir(gguf_file))  # the same weights, widened to fp32 at load
    reference = greedy(dequantized, prompts_token_ids)
    assert greedy(kept, prompts_token_ids) == reference
    assert len({tuple(r) for r in reference}) > 1  # prompts lead to different continuations

    sequences = [p + r for p, r in zip(prompts_token_ids, reference)]
    skip = [len(p) for p in prompts_token_ids]
    diffs = [abs(a - b) for ra, rb in zip(teacher_forced_logprobs(kept, sequences, skip),
                                          teacher_forced_logprobs(dequantized, sequences, skip))
             for a, b in zip(ra, rb)]
    assert max(diffs) < 1e-3


def test_kept_quantized_layers_hold_blocks(tiny_llama_32: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear layer and the tied embedding / LM head hold uint8 blocks, shared, not copied."""
    from vllm_lite.attention.selector import get_attn_backend
    from vllm_lite.model.layers.linear import LinearBase
    from vllm_lite.model.loader import load_model, weight_bytes

    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    gguf_file = export_gguf(tiny_llama_32, tmp_path / "tiny-llama-q4_1.gguf", "llama", quant="Q4_1")
    config = EngineArgs(model=str(gguf_file), dtype="float32").create_engine_config()
    cpu = torch.device("cpu")
    model = load_model(config.model_config, get_attn_backend("torch", cpu, torch.float32), cpu)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.packed_weight, GGUFWeight) and m.packed_weight.qtype == GGML_TYPE_Q4_1
                           for m in linears)
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head.packed_weight, GGUFWeight)
    assert head.packed_weight.qweight.data_ptr() == embedding.weight.data_ptr()
    dense = EngineArgs(model=str(config.model_config.model), dtype="float32").create_engine_config()
    dense_model = load_model(dense.model_config, get_attn_backend("torch", cpu, torch.float32), cpu)
    assert weight_bytes(model) < 0.4 * weight_bytes(dense_model)


def test_gguf_quantization_needs_a_gguf_file(tiny_llama_32: Path) -> None:
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model file"):
        EngineArgs(model=str(tiny_llama_32), quantization="gguf").create_engine_config()


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_reader_maps_the_tensors_gguf_reads(tmp_path: Path, alignment: int | None) -> None:
    """`read_gguf_tensors` (one pass over the header) gives gguf's reader's tensors: names, types,
    shapes and bytes, whatever metadata comes before them (string / number / nested arrays,
    bools, floats) and a custom alignment; `gguf_architecture` reads the first field."""
    import gguf

    from vllm_lite.gguf_convert import gguf_architecture, read_gguf_tensors

    rng = np.random.default_rng(0)
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_array("test.numbers", [1, 2, 3])
    writer.add_array("test.nested", [["a", "bc"], ["d"]])
    writer.add_bool("test.flag", True)
    writer.add_float32("test.scale", 0.5)
    writer.add_tensor("token_embd.weight", rng.standard_normal((7, 64)).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    writer.add_tensor("blk.0.ffn_up.weight", random_blocks(rng, GGML_TYPE_Q8_0, 5, 64),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", random_blocks(rng, GGML_TYPE_Q4_1, 3, 96),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, theirs = read_gguf_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [(t.name, t.tensor_type, t.shape) for t in ours] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in theirs]
    for mine, reference in zip(ours, theirs):
        assert mine.data.dtype == reference.data.dtype and np.array_equal(mine.data, reference.data), mine.name
    assert gguf_architecture(path) == "llama"
