"""Greedy token-for-token parity with Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_reference import hf_greedy
from vllm_lite import LLM, SamplingParams
from vllm_lite.model.layers import matmul_rows
from vllm_lite.model.layers.matmul_rows import bucket_rows

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run_greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def assert_no_leaked_blocks(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_llama_tied", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_matches_transformers(name: str, tiny_models: dict[str, Path],
                                     prompts_token_ids: list[list[int]]) -> None:
    model = tiny_models[name]
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(model, prompts_token_ids, NEW_TOKENS)
    assert_no_leaked_blocks(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="matmul buckets are the CPU model runner's")
@pytest.mark.parametrize("name, padded", [("tiny_qwen3", True), ("tiny_qwen3_moe", False)])
def test_steps_padded_to_a_matmul_bucket_keep_parity(name: str, padded: bool, request: pytest.FixtureRequest,
                                                     prompts_token_ids: list[list[int]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU a step whose token count is no matmul bucket size goes through the model padded to
    one (ModelRunner._padded_to_bucket): no linear layer pads its own input, the attention
    leaves the padded rows out, and every request's tokens stay HF's. A MoE model is not padded
    (its experts would compute the padded rows): its linears pad their own inputs, as before.
    37 requests: 37-row decode steps (bucket 38) and prefill chunks of 64 tokens, none full."""
    model_dir = request.getfixturevalue(name)
    prompts = [prompts_token_ids[i % 8][:5 + i] for i in range(37)]
    llm = LLM(str(model_dir), max_model_len=256, dtype="float32", multiprocess=False,
              max_num_batched_tokens=64)
    rows_in: list[int] = []
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    forward = model.forward

    def recording_forward(input_ids, positions, kv_caches, attn_metadata):
        rows_in.append(input_ids.shape[0])
        assert attn_metadata.num_tokens <= input_ids.shape[0]
        return forward(input_ids, positions, kv_caches, attn_metadata)

    model.forward = recording_forward
    pads: list[int] = []
    real_pad = torch.nn.functional.pad
    monkeypatch.setattr(matmul_rows, "F", SimpleNamespace(
        pad=lambda x, *args: pads.append(x.shape[0]) or real_pad(x, *args)))
    assert run_greedy(llm, prompts) == hf_greedy(model_dir, prompts, NEW_TOKENS)
    if padded:
        assert 37 not in rows_in and 38 in rows_in and all(bucket_rows(rows) == rows for rows in rows_in)
        assert pads == []
    else:
        assert 37 in rows_in and 37 in pads
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("fixture", ["tiny_llama_sharded", "tiny_llama3_rope"])
def test_sharded_checkpoint_and_llama3_rope(fixture: str, request: pytest.FixtureRequest,
                                            prompts_token_ids: list[list[int]]) -> None:
    model = request.getfixturevalue(fixture)
    llm = LLM(str(model), max_model_len=256, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(model, prompts_token_ids, NEW_TOKENS)


def test_prefix_caching_shared_prefix(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    shared = prompts_token_ids[-1][:48]  # three full blocks of 16
    prompts = [shared + p[:12] for p in prompts_token_ids]
    llm = LLM(str(tiny_qwen3), max_model_len=256, block_size=16, dtype="float32", multiprocess=False)
    expected = hf_greedy(tiny_qwen3, prompts, NEW_TOKENS)
    assert run_greedy(llm, prompts[:1]) == expected[:1]
    assert run_greedy(llm, prompts) == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 48 * (len(prompts) - 1)
    assert_no_leaked_blocks(llm)
    # A repeat of everything hits the cached full blocks of prompts and outputs alike.
    assert run_greedy(llm, prompts) == expected
    assert llm.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]


def test_cache_salt_separates_prefix_caches(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    """Finding 13: `cache_salt` (vLLM's prompt key) reaches the engine core and is mixed into the
    first block's key: equal prompts share cached blocks only under the same salt, and the
    output stays the transformers output either way."""
    prompt = prompts_token_ids[-1][:64]  # four full blocks of 16
    expected = hf_greedy(tiny_qwen3, [prompt], NEW_TOKENS)[0]
    llm = LLM(str(tiny_qwen3), max_model_len=256, block_size=16, multiprocess=False)

    def hits_after(salt: str | None) -> int:
        before = llm.stats()["prefix_cache_hits"]
        item = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt is not None else {})}
        output = llm.generate([item], GREEDY, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == expected
        return llm.stats()["prefix_cache_hits"] - before

    assert hits_after(None) == 0
    assert hits_after("tenant-a") == 0  # the unsalted blocks are not shared with a salted request
    assert hits_after("tenant-b") == 0
    assert hits_after("tenant-a") == 48  # same salt: 3 full blocks hit (the 4th holds the last token)
    assert hits_after(None) == 48
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], GREEDY, use_tqdm=False)
    assert_no_leaked_blocks(llm)


# Async scheduling is off by default on CPU (vLLM's CPU platform default); the chunked-prefill
# and preemption cases ask for it, so parity is checked with it on and off.
def test_chunked_prefill(tiny_llama: Path, prompts_token_ids: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=16, dtype="float32", multiprocess=False,
              async_scheduling=True)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(tiny_llama, prompts_token_ids, NEW_TOKENS)
    assert_no_leaked_blocks(llm)


def test_chunked_prefill_without_prefix_caching(tiny_qwen2: Path, prompts_token_ids: list[list[int]]) -> None:
    llm = LLM(str(tiny_qwen2), max_model_len=256, max_num_batched_tokens=16,
              enable_prefix_caching=False, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(tiny_qwen2, prompts_token_ids, NEW_TOKENS)
    assert llm.stats()["prefix_cache_hits"] == 0


def test_preemption(tiny_llama_tied: Path, prompts_token_ids: list[list[int]]) -> None:
    # 17 usable blocks of 16 tokens: the longest request alone needs 8 (90 + 32 tokens).
    llm = LLM(str(tiny_llama_tied), max_model_len=256, num_kv_blocks=18, block_size=16, dtype="float32",
              multiprocess=False, async_scheduling=True)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(tiny_llama_tied, prompts_token_ids, NEW_TOKENS)
    assert llm.stats()["num_preemptions"] > 0
    assert_no_leaked_blocks(llm)


def test_no_chunked_prefill(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    llm = LLM(str(tiny_qwen3), max_model_len=128, enable_chunked_prefill=False,
              max_num_batched_tokens=128, max_num_seqs=3, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == hf_greedy(tiny_qwen3, prompts_token_ids, NEW_TOKENS)
    assert_no_leaked_blocks(llm)
