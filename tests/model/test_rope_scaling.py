"""YaRN rope scaling (Qwen's and DeepSeek's long-context configs) against transformers, and the
context length a model takes as vLLM derives it (max_position_embeddings, the tokenizer's
model_max_length, a linear rope factor; LongRoPE's default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_copies import edited_copy
from hf_reference import build_tiny_model, hf_greedy
from test_parity import NEW_TOKENS, assert_no_leaked_blocks, run_greedy
from vllm_lite import LLM
from vllm_lite.config import EngineArgs, HFModelConfig
from vllm_lite.model.layers.rotary import RotaryEmbedding

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
YARN_VARIANTS = [
    YARN,
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16,
     "beta_slow": 2, "truncate": False},
    {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek's attention factor
    {**YARN, "attention_factor": 1.3},
    {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 100},  # the legacy key
]


def _qwen2_config(rope_scaling: dict[str, Any]) -> dict[str, Any]:
    return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=100, hidden_size=64,
                intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, rope_theta=10000.0, rope_scaling=dict(rope_scaling))


@pytest.mark.parametrize("rope_scaling", YARN_VARIANTS, ids=range(len(YARN_VARIANTS)))
def test_yarn_cos_sin_equal_transformers(rope_scaling: dict[str, Any]) -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    raw = _qwen2_config(rope_scaling)
    hf = HFModelConfig.from_dict(dict(raw), {})
    ours = RotaryEmbedding(hf.head_dim, 128, hf.rope_theta, hf.rope_scaling)
    reference = Qwen2RotaryEmbedding(Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"}))
    cos, sin = reference(torch.zeros(1, 1), torch.arange(128)[None])
    assert torch.equal(ours.cos_cache, cos[0]) and torch.equal(ours.sin_cache, sin[0])


def test_yarn_config_keys_are_checked() -> None:
    with pytest.raises(ValueError, match="lacks factor"):
        HFModelConfig.from_dict(_qwen2_config({"rope_type": "yarn", "original_max_position_embeddings": 32}), {})
    with pytest.raises(ValueError, match="extrapolation_factor"):  # vLLM's own name, not a config key
        HFModelConfig.from_dict(_qwen2_config({**YARN, "extrapolation_factor": 1.0}), {})


@pytest.fixture(scope="module")
def tiny_qwen3_yarn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_qwen3`` weights, YaRN x4 over a pretrained context of 32 positions (128 stated)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_yarn"), "qwen3", tie_word_embeddings=True,
                            head_dim=32, rope_scaling=dict(YARN), extra_config={"max_position_embeddings": 128})


def test_yarn_model_matches_transformers(tiny_qwen3_yarn: Path, tiny_qwen3: Path,
                                         prompts_token_ids: list[list[int]]) -> None:
    expected = hf_greedy(tiny_qwen3_yarn, prompts_token_ids, NEW_TOKENS)
    assert expected != hf_greedy(tiny_qwen3, prompts_token_ids, NEW_TOKENS)  # the scaling matters
    llm = LLM(str(tiny_qwen3_yarn), dtype="float32", multiprocess=False)
    assert llm.llm_engine.vllm_config.model_config.max_model_len == 128
    assert run_greedy(llm, prompts_token_ids) == expected
    assert_no_leaked_blocks(llm)


def _max_model_len(model: Path, **engine_args: Any) -> int:
    return EngineArgs(model=str(model), **engine_args).create_engine_config().model_config.max_model_len


def test_yarn_context_is_max_position_embeddings_as_vllm_reads_it(tiny_qwen3_yarn: Path) -> None:
    with pytest.raises(ValueError, match=r"max_model_len=129 exceeds .*128.*hf_overrides"):
        _max_model_len(tiny_qwen3_yarn, max_model_len=129)
    assert _max_model_len(tiny_qwen3_yarn, hf_overrides={"max_position_embeddings": 256}) == 256


def test_context_is_capped_by_the_tokenizer_and_stretched_by_a_linear_factor(tiny_llama: Path,
                                                                             tmp_path: Path) -> None:
    short = edited_copy(tiny_llama, tmp_path / "short", {"model_max_length": 100}, file="tokenizer_config.json")
    assert _max_model_len(short) == 100
    with pytest.raises(ValueError, match="model_max_length=100"):
        _max_model_len(short, max_model_len=101)
    linear = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert _max_model_len(short, hf_overrides=linear) == 200
    assert _max_model_len(tiny_llama, hf_overrides=linear) == 1024


def test_a_longer_context_needs_vllms_escape_hatch(tiny_llama: Path, tiny_opt: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 allows it"):
        _max_model_len(tiny_llama, max_model_len=600)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert _max_model_len(tiny_llama, max_model_len=600) == 600  # rotary positions go on
    with pytest.raises(ValueError, match="learned table"):  # OPT's position table ends
        _max_model_len(tiny_opt, max_model_len=4096)


def test_longrope_defaults_to_its_pretrained_context(tiny_phi3: Path) -> None:
    assert _max_model_len(tiny_phi3) == 256  # vLLM's default: original_max_position_embeddings
