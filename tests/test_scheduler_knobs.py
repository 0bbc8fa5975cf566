"""vLLM's scheduler and model knobs beyond the basics: `long_prefill_token_threshold` (prompt
chunks capped while other requests are in the engine; greedy tokens unchanged, also when enough
requests run for the scheduler's array path), `disable_cascade_attn` (only its default, True:
there is no cascade attention here), `disable_sliding_window` (the context capped at the window),
and what RL frameworks pass (enable_sleep_mode, disable_custom_all_reduce, pipeline_parallel_size=1,
enable_expert_parallel=False)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import hf_greedy
from llm_factory import make_llm
from vllm_lite import SamplingParams

NEW_TOKENS = 6


def test_capped_prompt_chunks_keep_the_tokens(tiny_llama: Path) -> None:
    prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + (i * 13) % 40)] for i in range(60)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_llama, long_prefill_token_threshold=8, block_size=16, max_num_seqs=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens[:4] == hf_greedy(tiny_llama, prompts[:4], NEW_TOKENS)
    plain = make_llm(tiny_llama, block_size=16, max_num_seqs=64)
    try:
        expected = [list(o.outputs[0].token_ids)
                    for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    finally:
        plain.shutdown()
    assert tokens == expected


@pytest.mark.parametrize("arguments, message", [
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be in \\[0, max_model_len=256\\]"),
    ({"long_prefill_token_threshold": 300}, "long_prefill_token_threshold must be in"),
    ({"long_prefill_token_threshold": 8, "enable_chunked_prefill": False, "max_num_batched_tokens": 256},
     "needs enable_chunked_prefill"),
    ({"disable_cascade_attn": False}, "cascade attention is not implemented"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2: pipeline parallelism is not implemented"),
    ({"enable_expert_parallel": True}, "enable_expert_parallel=True: expert parallelism is not implemented"),
])
def test_knob_values_that_cannot_hold_are_refused(tiny_llama: Path, arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_llm(tiny_llama, **arguments)


def test_what_rl_frameworks_pass_is_taken(tiny_llama: Path) -> None:
    """TRL's, verl's and OpenRLHF's LLM(...) arguments: enable_sleep_mode (sleep works either way
    here), disable_custom_all_reduce (no custom kernel exists), pipeline_parallel_size=1,
    enable_expert_parallel=False; the engine then sleeps, wakes and generates transformers' tokens."""
    prompt = [5, 17, 99, 4, 250]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_llama, enable_sleep_mode=True, disable_custom_all_reduce=True, pipeline_parallel_size=1,
                   enable_expert_parallel=False, device="cpu")  # (sleep level 1 on CUDA: refused by name)
    try:
        llm.sleep(level=1)
        llm.wake_up()
        tokens = list(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.shutdown()
    assert tokens == hf_greedy(tiny_llama, [prompt], NEW_TOKENS)[0]


def test_disable_sliding_window_caps_the_context_at_the_window(tiny_mistral_window: Path,
                                                               tiny_gpt_oss: Path) -> None:
    """vLLM's disable_sliding_window: max_model_len becomes the window (8 and 8 here), where the
    sliding layers attend as full attention; a longer max_model_len is refused naming it."""
    for model in (tiny_mistral_window, tiny_gpt_oss):
        llm = make_llm(model, max_model_len=None, disable_sliding_window=True)
        try:
            assert llm.llm_engine.vllm_config.model_config.max_model_len == 8
            prompt = [5, 6, 7, 8]
            output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                 ignore_eos=True), use_tqdm=False)
            assert list(output[0].outputs[0].token_ids) == hf_greedy(model, [prompt], 4)[0]
        finally:
            llm.shutdown()
        with pytest.raises(ValueError, match="exceeds the model's context of 8 positions \\(sliding_window=8, with "
                                             "disable_sliding_window\\)"):
            make_llm(model, max_model_len=9, disable_sliding_window=True)


def test_fewer_active_requests_keep_the_tokens(tiny_llama: Path) -> None:
    prompts = [[(5 * i + j) % 900 + 3 for j in range(4 + i)] for i in range(6)]
    llm = make_llm(tiny_llama, max_num_active_seqs=2)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(tiny_llama, prompts, NEW_TOKENS)
    with pytest.raises(ValueError, match="max_num_active_seqs must be in \\[1, max_num_seqs=4\\]"):
        make_llm(tiny_llama, max_num_seqs=4, max_num_active_seqs=5)
