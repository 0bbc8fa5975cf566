"""Sliding-window attention: a Mistral whose window (8) is much shorter than its prompts (up to
90 tokens, eleven windows), against transformers, through every CPU attention path."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint_copies import edited_copy
from hf_reference import hf_greedy
from test_parity import NEW_TOKENS, assert_no_leaked_blocks, run_greedy
from vllm_lite import LLM
from vllm_lite import _custom_ops as cpu_native


@pytest.fixture(scope="module")
def expected(tiny_mistral_window: Path, _prompt_ids: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return hf_greedy(tiny_mistral_window, [list(p) for p in _prompt_ids], NEW_TOKENS)


def test_the_window_changes_the_result(tiny_mistral_window: Path, prompts_token_ids: list[list[int]],
                                       expected: list[list[int]], tmp_path: Path) -> None:
    """Guards the fixture: ignoring the window would give other tokens."""
    full = edited_copy(tiny_mistral_window, tmp_path / "no_window", {"sliding_window": None})
    without_window = hf_greedy(full, prompts_token_ids, NEW_TOKENS)
    assert sum(a != b for a, b in zip(expected, without_window)) >= 4
    llm = LLM(str(tiny_mistral_window), max_model_len=256, dtype="float32", multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) != without_window


BACKENDS = ["torch"] + (["cpu_native"] if cpu_native.is_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_window_matches_transformers(backend: str, tiny_mistral_window: Path,
                                             prompts_token_ids: list[list[int]],
                                             expected: list[list[int]]) -> None:
    llm = LLM(str(tiny_mistral_window), max_model_len=256, dtype="float32", attention_backend=backend, multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == expected
    assert_no_leaked_blocks(llm)


def test_window_with_chunked_prefill_prefix_caching_and_preemption(
        tiny_mistral_window: Path, prompts_token_ids: list[list[int]], expected: list[list[int]]) -> None:
    # block_size 4 (two blocks per window), 12-token chunks: a request holds at most 6 blocks at
    # once (its window's and its chunk's; 31 without freeing), 8 requests share 15.
    llm = LLM(str(tiny_mistral_window), max_model_len=256, dtype="float32", block_size=4, num_kv_blocks=16,
              max_num_batched_tokens=12, multiprocess=False)
    assert run_greedy(llm, prompts_token_ids) == expected
    assert run_greedy(llm, prompts_token_ids) == expected  # again, over prefix-cache hits
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert_no_leaked_blocks(llm)
