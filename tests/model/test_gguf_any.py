"""A `.gguf` path loads any supported architecture (here Qwen2 and Qwen3, written from tiny
random checkpoints as fp32 GGUF files), converted once into a cached Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_export import export_gguf
from hf_reference import hf_greedy
from test_parity import NEW_TOKENS, run_greedy
from vllm_lite import LLM

pytest.importorskip("gguf")


@pytest.mark.parametrize("fixture,arch", [("tiny_qwen2", "qwen2"), ("tiny_qwen3", "qwen3")])
def test_gguf_file_matches_its_source_checkpoint(fixture: str, arch: str, request: pytest.FixtureRequest,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 prompts_token_ids: list[list[int]]) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    source: Path = request.getfixturevalue(fixture)
    gguf_file = export_gguf(source, tmp_path / f"tiny-{arch}.gguf", arch)
    llm = LLM(str(gguf_file), max_model_len=256, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(source, prompts_token_ids, NEW_TOKENS)
    converted = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()


def test_quantized_gguf_folder_holds_the_dequantized_weights(tiny_qwen2: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             prompts_token_ids: list[list[int]]) -> None:
    """The converted folder (config, tokenizer, and the weights widened to float32: what a
    dequantized run and transformers load); the engine itself keeps the file's blocks
    (tests/model/test_gguf_quantized.py)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path / "cache"))
    gguf_file = export_gguf(tiny_qwen2, tmp_path / "tiny-qwen2-q8.gguf", "qwen2", quantize_q8=True)
    llm = LLM(str(gguf_file), max_model_len=256, dtype="float32", multiprocess=False)
    (converted,) = (tmp_path / "cache" / "gguf").iterdir()
    name = "model.layers.0.mlp.down_proj.weight"
    original = load_file(str(tiny_qwen2 / "model.safetensors"))[name]
    dequantized = load_file(str(converted / "model.safetensors"))[name]
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert dequantized.dtype == np.float32
    assert np.array_equal(dequantized, gguf.quants.dequantize(gguf.quants.quantize(original, q8), q8))
    assert 0 < np.abs(dequantized - original).max() < 0.01  # quantized, and close
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(converted, prompts_token_ids, NEW_TOKENS)
