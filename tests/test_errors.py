"""Bad input gets a clear error naming the problem, never a crash."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint_copies import edited_copy
from vllm_lite import LLM, SamplingParams


def test_unknown_architecture_lists_supported(tiny_llama: Path, tmp_path: Path) -> None:
    # but model_type llama: no fallback either
    model = edited_copy(tiny_llama, tmp_path / "model", {"architectures": ["CohereForCausalLM"]})
    with pytest.raises(ValueError, match="CohereForCausalLM.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(model), multiprocess=False)


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: .*nope' is neither an existing folder"):
        LLM(str(tmp_path / "nope"), multiprocess=False)


def test_prompt_longer_than_max_model_len(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), max_model_len=32, multiprocess=False)
    with pytest.raises(ValueError, match="40 tokens, more than max_model_len=32"):
        llm.generate({"prompt_token_ids": list(range(3, 43))}, use_tqdm=False)
    # The engine still serves after the rejection.
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_max_tokens_below_one() -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 12, "block_size must be a power of two"),
    ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
    ("dtype", "float8", "dtype must be one of"),
    ("device", "tpu", "device must be one of"),
    ("max_model_len", 4096, "max_model_len=4096 exceeds"),
    # 0 is a value, not "unset" (it once silently meant the model's own maximum / the default budget)
    ("max_model_len", 0, "max_model_len must be >= 1, got 0"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be >= 1, got 0"),
    ("num_kv_blocks", 1, r"num_kv_blocks must be >= 2 \(block 0 is reserved\), got 1"),
    ("kv_cache_memory_bytes", 0, "kv_cache_memory_bytes must be > 0, got 0"),
    ("tokenizer_mode", "mistral", "tokenizer_mode must be one of .*got 'mistral'"),
])
def test_engine_args_validation(tiny_llama: Path, field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), multiprocess=False, **{field: value})


def test_unknown_engine_argument(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(tiny_llama), max_num_sequences=4, multiprocess=False)


def test_token_id_outside_vocabulary(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), max_model_len=64, multiprocess=False)
    with pytest.raises(ValueError, match="prompt_token_ids must be in"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)


def test_request_too_large_for_kv_cache(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), max_model_len=256, num_kv_blocks=3, block_size=16, multiprocess=False)
    with pytest.raises(ValueError, match="needs up to .* KV blocks"):
        llm.generate({"prompt_token_ids": list(range(3, 60))}, SamplingParams(max_tokens=8), use_tqdm=False)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
