"""The native LM-head kernels (csrc/greedy_head_ops.cpp, layers/head_panels.py): logits equal to
the matmul's, the greedy tokens equal to those logits' argmax (first maximum), and the engine
taking the tokens without the logits only in the steps that ask for nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from llm_factory import make_llm

from vllm_lite import SamplingParams
from vllm_lite import _custom_ops as cpu_native
from vllm_lite.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vllm_lite.model.layers.head_panels import HeadPanels

pytestmark = pytest.mark.skipif(not cpu_native.is_available(), reason="vllm_lite._C is not built")
# The LM head takes the kernels at AVX2 and AVX-512 only (head_panels_usable).
head_on_panels = pytest.mark.skipif(cpu_native.is_available() and cpu_native.cpu_capability() == "default",
                                    reason="the baseline level keeps oneDNN's LM head")

# Row counts around the kernels' tiles (12 rows on AVX-512, 5 below; tails of 1, 2, 4 and 8);
# vocabularies around the 32-entry padding and the 16-entry panels.
ROWS = (1, 2, 3, 5, 8, 12, 13, 25, 64)
VOCABS = (1, 15, 16, 31, 33, 1000)


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The kernels split the vocabulary between threads; 3 makes uneven shares."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def random_case(rows: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=generator), torch.randn(vocab, hidden, generator=generator)


@pytest.mark.parametrize("hidden", [7, 64])
@pytest.mark.parametrize("vocab", VOCABS)
def test_logits_match_the_matmul(threads: int, vocab: int, hidden: int) -> None:
    for rows in ROWS:
        x, weight = random_case(rows, hidden, vocab, seed=rows * vocab + hidden)
        logits = cpu_native.head_logits(x, cpu_native.pack_head_panels(weight), vocab)
        expected = (x.double() @ weight.double().T).float()
        assert logits.shape == (rows, vocab)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("vocab", [*VOCABS, 8190])
def test_greedy_tokens_are_the_first_maximum_of_the_logits(threads: int, vocab: int) -> None:
    for rows in ROWS:
        x, weight = random_case(rows, 32, vocab, seed=rows + vocab)
        panels = cpu_native.pack_head_panels(weight)
        tokens = cpu_native.greedy_head(x, panels, vocab)
        assert tokens.dtype == torch.int64
        assert torch.equal(tokens, cpu_native.head_logits(x, panels, vocab).argmax(dim=-1))


def test_ties_go_to_the_first_column_across_lanes_panels_and_threads(threads: int) -> None:
    """Equal logits in several lanes, panels and thread shares: the smallest column wins."""
    vocab, hidden = 1000, 8
    weight = torch.zeros(vocab, hidden)
    winners = [[999], [3, 500, 999], [17, 18, 33], [600, 601, 998], [0, 999]]
    for row, columns in enumerate(winners):
        weight[columns, row] = 1.0
    x = torch.eye(5, hidden)
    tokens = cpu_native.greedy_head(x, cpu_native.pack_head_panels(weight), vocab)
    assert tokens.tolist() == [min(columns) for columns in winners]


def test_padding_past_the_vocabulary_never_wins(threads: int) -> None:
    """Every logit negative: the zero-padded entries after the last real one (a vocabulary of 33
    pads to 64) must not be taken for a maximum."""
    vocab, hidden = 33, 4
    weight = -torch.rand(vocab, hidden, generator=torch.Generator().manual_seed(0)) - 0.5
    x = torch.rand(7, hidden, generator=torch.Generator().manual_seed(1)) + 0.5
    tokens = cpu_native.greedy_head(x, cpu_native.pack_head_panels(weight), vocab)
    assert torch.equal(tokens, (x @ weight.T).argmax(dim=-1))
    assert int(tokens.max()) < vocab


def test_kernels_refuse_mismatched_inputs() -> None:
    panels = cpu_native.pack_head_panels(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="hidden states' width"):
        cpu_native.head_logits(torch.randn(2, 9), panels, 40)
    with pytest.raises(RuntimeError, match="vocab_size"):
        cpu_native.greedy_head(torch.randn(2, 8), panels, 65)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_native.greedy_head(torch.randn(2, 8, dtype=torch.float64), panels, 40)


@head_on_panels
@pytest.mark.parametrize("tied", [False, True])
def test_an_fp32_lm_head_keeps_panels_in_place_of_onednn(tied: bool) -> None:
    vocab, hidden = 300, 24
    head = ParallelLMHead(vocab, hidden)
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(2))
    if tied:
        embedding = VocabParallelEmbedding(vocab, hidden)
        embedding.weight.data.copy_(weight)
        head.tie_weights(embedding)
    else:
        head.weight.data.copy_(weight)
    head.process_weights_after_loading()
    assert isinstance(head.packed_weight, HeadPanels)
    assert head.weight.device.type == ("cpu" if tied else "meta")  # the embedding lookup keeps a tied weight
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(3))
    logits = head.compute_logits(x)
    torch.testing.assert_close(logits, x @ weight.T, atol=1e-4, rtol=1e-5)
    assert torch.equal(head.greedy_tokens(x), logits.argmax(dim=-1))


def test_the_baseline_level_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "cpu_capability", lambda: "default")
    head = ParallelLMHead(64, 16)
    head.process_weights_after_loading()
    assert not isinstance(head.packed_weight, HeadPanels)
    assert head.greedy_tokens(torch.randn(2, 16)) is None


def test_a_bf16_lm_head_has_no_greedy_path() -> None:
    head = ParallelLMHead(64, 16).to(torch.bfloat16)
    head.process_weights_after_loading()
    assert not isinstance(head.packed_weight, HeadPanels)
    assert head.greedy_tokens(torch.randn(2, 16, dtype=torch.bfloat16)) is None


@head_on_panels
def test_the_engine_skips_the_logits_only_when_nothing_else_is_asked(
        tiny_llama_tied: Path, prompts_token_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """All-greedy steps take their tokens from the fused kernel; a step with a row asking for
    logprobs computes the logits. The greedy rows' tokens are the same either way."""
    llm = make_llm(tiny_llama_tied)
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        calls = {"greedy": 0, "logits": 0}
        compute_greedy_tokens, compute_logits = runner.model.compute_greedy_tokens, runner.model.compute_logits

        def counted(name, method):
            def call(hidden):
                calls[name] += 1
                return method(hidden)
            return call

        monkeypatch.setattr(runner.model, "compute_greedy_tokens", counted("greedy", compute_greedy_tokens))
        monkeypatch.setattr(runner.model, "compute_logits", counted("logits", compute_logits))
        prompts = [{"prompt_token_ids": ids} for ids in prompts_token_ids]
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert calls["greedy"] >= 11 and calls["logits"] <= 1  # (the first sampling step learns the width)
        calls.update(greedy=0, logits=0)
        with_logprobs = [greedy] * (len(prompts) - 1) + [SamplingParams(temperature=0.0, max_tokens=12,
                                                                        ignore_eos=True, logprobs=1)]
        unfused = [o.outputs[0].token_ids for o in llm.generate(prompts, with_logprobs, use_tqdm=False)]
        assert calls["greedy"] == 0 and calls["logits"] >= 12
        assert [list(t) for t in fused] == [list(t) for t in unfused]
    finally:
        llm.shutdown()
