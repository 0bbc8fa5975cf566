"""TP=2 greedy parity with transformers for GPT-2 / GPTBigCode / GPT-NeoX / Bloom / Falcon / MPT
(fused q / k / v read apart, then sharded; a single key / value head replicated; ALiBi slopes per
rank), Gemma 3 (local/global layers, qk-norm), Phi-3
(fused checkpoint tensors split per rank), Mistral with a sliding window (blocks freed) and the
mixture-of-experts families (each expert's intermediate dimension split over the ranks), and the
language models of multimodal checkpoints (their tensors renamed, then sharded), with chunked
prefill and prefix caching."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hf_reference import hf_greedy
from test_tensor_parallel import NEW_TOKENS, run_greedy, shared_prefix_prompts, tp_llm  # noqa: F401
from vllm_lite import LLM


@pytest.mark.parametrize("fixture", ["tiny_gemma", "tiny_gemma3", "tiny_bloom", "tiny_falcon_40b", "tiny_mpt",
                                     "tiny_gpt2", "tiny_gpt_bigcode", "tiny_gpt_bigcode_mha", "tiny_gpt_neox",
                                     "tiny_gptj", "tiny_phi2", "tiny_stablelm", "tiny_granite", "tiny_phi3", "tiny_phi4_mini",
                                     "tiny_mixtral", "tiny_qwen3_moe", "tiny_qwen2_moe", "tiny_smollm3", "tiny_starcoder2", "tiny_olmo",
                                     "tiny_olmo2", "tiny_mistral_window",
                                     # multimodal checkpoints, served as their language model
                                     "tiny_gemma3_mm", "tiny_qwen2_5_vl"])
def test_tp2_family_matches_transformers(fixture: str, request: pytest.FixtureRequest,
                                         prompts_token_ids: list[list[int]],
                                         tp_llm: Callable[..., LLM]) -> None:  # noqa: F811
    model: Path = request.getfixturevalue(fixture)
    prompts = prompts_token_ids + shared_prefix_prompts(prompts_token_ids)
    tp2 = tp_llm(model, max_num_batched_tokens=16, enable_prefix_caching=True, enable_chunked_prefill=True,
                 block_size=16)
    assert run_greedy(tp2, prompts) == hf_greedy(model, prompts, NEW_TOKENS)
    stats = tp2.stats()
    assert stats["prefix_cache_hits"] >= 48 * 3, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
