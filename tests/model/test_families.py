"""Greedy parity with transformers for the families beyond Llama/Qwen (fp32, CPU, tiny random
weights): 8 prompts x 32 tokens, once plainly (async scheduling off, the CPU default) and once
with async scheduling, 16-token chunks, a cache small enough to force preemption, and a second
pass over prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint_copies import edited_copy
from hf_reference import hf_greedy, hf_logits
from test_parity import NEW_TOKENS, assert_no_leaked_blocks, run_greedy
from vllm_lite import LLM

FAMILIES = ["tiny_bloom", "tiny_falcon", "tiny_falcon_40b", "tiny_falcon_sequential", "tiny_gemma", "tiny_gemma2",
            "tiny_gemma3", "tiny_gpt2", "tiny_gpt_bigcode", "tiny_gpt_bigcode_mha", "tiny_gpt_neox",
            "tiny_gpt_neox_serial", "tiny_gptj", "tiny_granite", "tiny_mixtral", "tiny_mpt", "tiny_olmo", "tiny_olmo2",
            "tiny_opt", "tiny_opt_post_norm", "tiny_phi2", "tiny_phi3", "tiny_phi4_mini", "tiny_qwen3_moe", "tiny_qwen2_moe", "tiny_qwen2_window",
            "tiny_smollm3", "tiny_stablelm", "tiny_stablelm_parallel", "tiny_starcoder2",
            # no native implementation: the Transformers fallback, chosen automatically
            "tiny_cohere", "tiny_codegen", "tiny_olmoe", "tiny_deepseek_v2", "tiny_deepseek_v3", "tiny_gpt_oss", "tiny_gemma3n",
            "tiny_gemma4"]


@pytest.mark.parametrize("fixture", FAMILIES)
def test_family_matches_transformers(fixture: str, request: pytest.FixtureRequest,
                                     prompts_token_ids: list[list[int]]) -> None:
    model: Path = request.getfixturevalue(fixture)
    expected = hf_greedy(model, prompts_token_ids, NEW_TOKENS)
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == expected
    llm.shutdown()
    # 17 usable blocks of 16 tokens (the longest request needs 8), chunks of 16 tokens.
    llm = LLM(str(model), max_model_len=256, dtype="float32", num_kv_blocks=18, block_size=16, max_num_batched_tokens=16,
              multiprocess=False, async_scheduling=True)
    assert run_greedy(llm, prompts_token_ids) == expected
    assert run_greedy(llm, prompts_token_ids) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_family_logprobs_match_transformers(fixture: str, request: pytest.FixtureRequest,
                                            prompts_token_ids: list[list[int]]) -> None:
    """Each prompt token's logprob given the tokens before it, against transformers' logits: a
    closer check than greedy tokens (an approximate activation or a scale slightly off keeps
    most argmaxes)."""
    import torch

    from vllm_lite import SamplingParams

    model: Path = request.getfixturevalue(fixture)
    prompts = prompts_token_ids[2:5]
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():  # (the cached model ran under it: Phi-3's longrope updates its buffers)
            logits = hf_logits(model, prompt)
        want = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), prompt[1:]]
        got = torch.tensor([entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


def test_granite_runs_natively(tiny_granite: Path) -> None:
    """(Granite ran on the Transformers fallback before its multipliers were implemented.)"""
    from vllm_lite.config import EngineArgs

    assert EngineArgs(model=str(tiny_granite)).create_engine_config().model_config.hf.model_impl == "vllm"


def test_starcoder2_sliding_window_matches_transformers(tiny_starcoder2: Path, tmp_path: Path,
                                                       prompts_token_ids: list[list[int]]) -> None:
    """StarCoder2's `sliding_window` covers every layer (prompts up to 90 tokens, window 8)."""
    windowed = edited_copy(tiny_starcoder2, tmp_path / "windowed", {"sliding_window": 8})
    expected = hf_greedy(windowed, prompts_token_ids, NEW_TOKENS)
    assert expected != hf_greedy(tiny_starcoder2, prompts_token_ids, NEW_TOKENS)  # (the window matters)
    llm = LLM(str(windowed), max_model_len=256, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == expected
    llm.shutdown()


def test_bloom_alibi_on_the_torch_backend(tiny_bloom: Path, prompts_token_ids: list[list[int]]) -> None:
    """ALiBi through the plain torch attention backend too (the families above run the CPU
    backend, whose decode kernel hands ALiBi layers to the torch paths), chunked and prefix-cached."""
    expected = hf_greedy(tiny_bloom, prompts_token_ids, NEW_TOKENS)
    llm = LLM(str(tiny_bloom), max_model_len=256, dtype="float32", multiprocess=False, attention_backend="torch",
              block_size=16, max_num_batched_tokens=16)
    try:
        assert run_greedy(llm, prompts_token_ids) == expected
        assert run_greedy(llm, prompts_token_ids) == expected
        assert llm.stats()["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()


def test_gpt_oss_attention_sinks_on_the_torch_backend(tiny_gpt_oss: Path, prompts_token_ids: list[list[int]]) -> None:
    """Attention sinks (gpt-oss through the Transformers fallback) through the plain torch backend
    too (the families above run the CPU backend, which hands layers with sinks to its torch paths)."""
    expected = hf_greedy(tiny_gpt_oss, prompts_token_ids, NEW_TOKENS)
    llm = LLM(str(tiny_gpt_oss), max_model_len=256, dtype="float32", multiprocess=False, attention_backend="torch",
              block_size=16, max_num_batched_tokens=16)
    try:
        assert run_greedy(llm, prompts_token_ids) == expected
    finally:
        llm.shutdown()


def test_mosaicmls_own_architecture_name_runs_natively(tiny_mpt: Path, tmp_path: Path,
                                                       prompts_token_ids: list[list[int]]) -> None:
    """MosaicML's configs name their custom class, `MPTForCausalLM` (with an auto_map to it): the
    native MPT runs it, no repository code."""
    model = edited_copy(tiny_mpt, tmp_path / "mpt", {"architectures": ["MPTForCausalLM"],
                                                     "auto_map": {"AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM"}})
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    try:
        assert run_greedy(llm, prompts_token_ids) == hf_greedy(tiny_mpt, prompts_token_ids, NEW_TOKENS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("key, value", [("clip_qkv", 6.0), ("qk_ln", True), ("alibi", False), ("rope", True)])
def test_mpt_attn_config_is_checked_key_by_key(tiny_mpt: Path, tmp_path: Path, key: str, value: object) -> None:
    model = edited_copy(tiny_mpt, tmp_path / "mpt", lambda config: config["attn_config"].update({key: value}))
    with pytest.raises(ValueError, match=f"attn_config.{key}"):
        LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
