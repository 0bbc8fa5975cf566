"""vLLM's thinking_token_budget: with the engine's reasoning_parser, a thinking section (after
`<think>`) gets at most `budget` tokens, then `</think>` is forced; counted from the prompt's open
section too, afresh for each section; refused by name where it cannot work."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llm_factory import make_llm

from vllm_lite import SamplingParams
from vllm_lite.core.thinking_budget import ThinkingBudgetState, forced_token_rows
from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.wire import ThinkingBudget

START, END = 7, 8  # (the state machine's tag ids in the unit tests)


def test_the_state_counts_each_open_section_and_forces_the_end() -> None:
    state = ThinkingBudgetState(ThinkingBudget(2, START, END), np.array([1, 2, 3]))
    assert not state.in_think and state.forced_token() is None
    for token in (4, START, 5):
        state.accept(token)
    assert state.forced_token() is None  # one thinking token so far
    state.accept(6)
    assert state.forced_token() == END
    state.accept(END)
    assert state.forced_token() is None and not state.in_think
    state.accept(START)  # a new section: a new count
    assert state.count == 0 and state.forced_token() is None


def test_a_prompt_s_open_section_counts_toward_the_budget() -> None:
    assert ThinkingBudgetState(ThinkingBudget(3, START, END), np.array([1, START, 4, 5])).count == 2
    assert ThinkingBudgetState(ThinkingBudget(0, START, END), np.array([1, START])).forced_token() == END
    closed = ThinkingBudgetState(ThinkingBudget(0, START, END), np.array([START, 4, END, 5]))
    assert not closed.in_think and closed.forced_token() is None


def test_forced_rows_allow_one_token_each() -> None:
    rows = forced_token_rows([0, 33, 63], 3)
    bits = ((rows[:, :, None].astype(np.int64) & 0xFFFFFFFF) >> np.arange(32)) & 1
    assert [list(np.flatnonzero(row.reshape(-1))) for row in bits] == [[0], [33], [63]]


@pytest.mark.parametrize(("budget", "async_scheduling"), [(0, False), (1, False), (3, False), (3, True), (0, True)])
def test_the_end_tag_is_forced_after_the_budget(tiny_thinking_qwen3: Path, budget: int, async_scheduling: bool) -> None:
    """Async scheduling too: the step after a budgeted request's is scheduled only once its
    token is known (the forced token depends on it)."""
    llm = make_llm(tiny_thinking_qwen3, reasoning_parser="qwen3", async_scheduling=async_scheduling)
    try:
        start, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
        prompt = {"prompt_token_ids": [5, 17, 300, start]}  # (a template that opens the section)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, thinking_token_budget=budget,
                                skip_special_tokens=False)
        free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        budgeted, unbudgeted = llm.generate([prompt, prompt], [params, free], use_tqdm=False)
        ids, free_ids = budgeted.outputs[0].token_ids, unbudgeted.outputs[0].token_ids
        assert end not in free_ids[:budget + 1]  # (else the test would show nothing)
        assert ids[:budget] == free_ids[:budget]  # thinking as it would, up to the budget
        assert ids[budget] == end
        assert budgeted.outputs[0].text.count("</think>") >= 1
    finally:
        llm.shutdown()


def test_no_open_section_means_no_forcing(tiny_thinking_qwen3: Path) -> None:
    llm = make_llm(tiny_thinking_qwen3, reasoning_parser="qwen3")
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, thinking_token_budget=0)
        free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        prompt = {"prompt_token_ids": [5, 17, 300]}
        budgeted, unbudgeted = llm.generate([prompt, prompt], [params, free], use_tqdm=False)
        start = llm.get_tokenizer().convert_tokens_to_ids("<think>")
        if start not in unbudgeted.outputs[0].token_ids:  # (the model never opens a section itself)
            assert budgeted.outputs[0].token_ids == unbudgeted.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_refused_by_name_where_it_cannot_work(tiny_thinking_qwen3: Path, tiny_qwen3: Path) -> None:
    with pytest.raises(VLLMValidationError, match="must be a non-negative integer or -1"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "unlimited"
    llm = make_llm(tiny_thinking_qwen3)  # no reasoning parser
    try:
        with pytest.raises(VLLMValidationError, match="set --reasoning-parser"):
            llm.generate("hi", SamplingParams(thinking_token_budget=4), use_tqdm=False)
    finally:
        llm.shutdown()
    llm = make_llm(tiny_qwen3, reasoning_parser="qwen3")  # a tokenizer without the tags
    try:
        with pytest.raises(VLLMValidationError, match="as single tokens"):
            llm.generate("hi", SamplingParams(thinking_token_budget=4), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="structured outputs"):
            llm.generate("hi", SamplingParams(thinking_token_budget=4, structured_outputs={"regex": "a+"}),
                         use_tqdm=False)
    finally:
        llm.shutdown()
    llm = make_llm(tiny_thinking_qwen3, reasoning_parser="granite")  # its markers are text
    try:
        with pytest.raises(VLLMValidationError, match="'granite' as single tokens; they are text"):
            llm.generate("hi", SamplingParams(thinking_token_budget=4), use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        make_llm(tiny_qwen3, reasoning_parser="nope")
