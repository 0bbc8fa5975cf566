"""vLLM's V1 custom logits processors (LLM(..., logits_processors=[...]), SamplingParams.extra_args):
processors written against vLLM's interface (tests/custom_logits_processors.py) see the batch as
vLLM describes it (BatchUpdate: removed, added with live output lists, moved), in vLLM's sampler
order; their per-request arguments are checked when a request arrives."""

from __future__ import annotations

from pathlib import Path

import pytest

from custom_logits_processors import EchoPrompt, ForcedToken, NotAProcessor, Sharpen
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.exceptions import VLLMValidationError

NEW_TOKENS = 12


def tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_forced_token_processor_steers_only_its_requests(tiny_llama: Path, prompts_token_ids: list[list[int]]) -> None:
    """vLLM's documented example: extra_args={"target_token": t} makes every token t; the other
    requests' tokens are those of an engine without the processor."""
    prompts = [{"prompt_token_ids": p} for p in prompts_token_ids[:4]]
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, extra_args={"target_token": 67})
    reference = make_llm(tiny_llama)
    try:
        expected = tokens(reference.generate(prompts, plain, use_tqdm=False))
    finally:
        reference.shutdown()
    llm = make_llm(tiny_llama, logits_processors=[ForcedToken])  # (a class: passed on by its name)
    try:
        got = tokens(llm.generate(prompts, [forced, plain, forced, plain], use_tqdm=False))
        with pytest.raises(VLLMValidationError, match="target_token must be an int, got 'x'"):
            llm.generate(prompts[0], SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)
        sampled = tokens(llm.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS,
                                                              ignore_eos=True, extra_args={"target_token": 5}),
                                      use_tqdm=False))
    finally:
        llm.shutdown()
    assert got[0] == got[2] == [67] * NEW_TOKENS
    assert got[1] == expected[1] and got[3] == expected[3]
    assert sampled == [[5] * NEW_TOKENS] * 4


@pytest.mark.parametrize("processor", ["EchoPrompt", "EchoPromptByDict"])
def test_a_processor_sees_the_batch_as_it_is_through_preemption_and_row_moves(
        tiny_llama: Path, prompts_token_ids: list[list[int]], processor: str) -> None:
    """EchoPrompt's tokens come from its own picture of the batch (rows, prompts, output lists):
    they are each prompt again only if every BatchUpdate was right. 16-token chunks, a cache small
    enough to preempt, at most 4 requests at once (requests leave and join, rows move)."""
    prompts = prompts_token_ids
    lengths = [NEW_TOKENS + 5 * (i % 4) for i in range(len(prompts))]  # (they finish apart: holes, row moves)
    params = [SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True,
                             extra_args={"echo": True} if i % 3 else None) for i in range(len(prompts))]
    reference = make_llm(tiny_llama)
    try:
        expected_plain = tokens(reference.generate([{"prompt_token_ids": p} for p in prompts],
                                                   [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                                    for n in lengths], use_tqdm=False))
    finally:
        reference.shutdown()
    llm = make_llm(tiny_llama, logits_processors=[f"custom_logits_processors:{processor}"], num_kv_blocks=9,
                   block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        got = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()
    for i, (prompt, output) in enumerate(zip(prompts, got)):
        expected = [prompt[k % len(prompt)] for k in range(lengths[i])] if i % 3 else expected_plain[i]
        assert output == expected, i


def test_argmax_invariant_processors_apply_to_random_rows_only(tiny_llama: Path,
                                                               prompts_token_ids: list[list[int]]) -> None:
    """Sharpen (argmax-invariant) makes a random draw the argmax; greedy requests are as without it."""
    prompts = [{"prompt_token_ids": p} for p in prompts_token_ids[:3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sharpened = SamplingParams(temperature=1.0, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True,
                               extra_args={"sharpen": True})
    random = SamplingParams(temperature=1.0, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = make_llm(tiny_llama, logits_processors=[Sharpen])
    try:
        expected = tokens(llm.generate(prompts, greedy, use_tqdm=False))
        assert tokens(llm.generate(prompts, sharpened, use_tqdm=False)) == expected
        assert tokens(llm.generate(prompts, random, use_tqdm=False)) != expected  # (sharpening did it)
        assert tokens(llm.generate(prompts, [greedy, sharpened, greedy], use_tqdm=False)) == expected
    finally:
        llm.shutdown()


def test_extra_args_are_refused_without_processors(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    try:
        with pytest.raises(VLLMValidationError, match=r"extra_args \(vllm_xargs\) are read by custom logits processors"):
            llm.generate("hello", SamplingParams(extra_args={"target_token": 1}), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("processors, message", [
    (["custom_logits_processors"], "Expected format: '<module>:<type>'"),
    (["no_such_module:Thing"], "'no_such_module:Thing' cannot be imported"),
    (["custom_logits_processors:Missing"], "cannot be imported"),
    ([NotAProcessor], "is not a subclass of vllm_lite.logits_processor.LogitsProcessor"),
    (["vllm_lite.logits_processor:LogitsProcessor"], "is abstract"),
    ([3], "must be classes or 'module:Class' names"),
])
def test_processors_that_cannot_run_are_refused_before_the_engine_starts(tiny_llama: Path, processors: list,
                                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_llama), logits_processors=processors).create_engine_config()


def test_processors_with_async_scheduling_or_pooling_are_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="logits_processors with async_scheduling=True is not implemented"):
        EngineArgs(model=str(tiny_llama), logits_processors=[ForcedToken], async_scheduling=True).create_engine_config()
    # unset, async scheduling is off with processors where it would be on (a CUDA device's default)
    assert EngineArgs(model=str(tiny_llama), device="cuda").create_engine_config().scheduler_config.async_scheduling
    config = EngineArgs(model=str(tiny_llama), logits_processors=[ForcedToken], device="cuda").create_engine_config()
    assert config.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="Pooling models do not support custom logits processors"):
        EngineArgs(model=str(tiny_llama), logits_processors=[ForcedToken], runner="pooling").create_engine_config()


def test_processor_instances_run_in_the_engine_core_process(tiny_llama: Path,
                                                            prompts_token_ids: list[list[int]]) -> None:
    """A multiprocess engine imports the processor by name in its own process."""
    llm = make_llm(tiny_llama, logits_processors=[ForcedToken], multiprocess=True)
    try:
        out = llm.generate({"prompt_token_ids": prompts_token_ids[0]},
                           SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"target_token": 9}),
                           use_tqdm=False)
    finally:
        llm.shutdown()
    assert out[0].outputs[0].token_ids == [9] * 4
