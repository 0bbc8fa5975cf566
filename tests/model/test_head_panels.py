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
from vllm_lite.model.layers.head_panels import SCREEN_MAX_COST, SCREEN_TRIAL_CALLS, HeadPanels, greedy_tokens

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
    if cpu_native.head_screen_supported():
        codes, stats = cpu_native.pack_head_screen(torch.randn(40, 8))
        with pytest.raises(RuntimeError, match="pack_head_screen"):
            cpu_native.greedy_head_screened(torch.randn(2, 8), panels, codes[:1], stats, 40)
        with pytest.raises(RuntimeError, match="vocab_size"):
            cpu_native.greedy_head_screened(torch.randn(2, 8), panels, codes, stats, 65)


# ---- greedy_head_screened: the same tokens as greedy_head, from int16 estimates first ----

screened = pytest.mark.skipif(not (cpu_native.is_available() and cpu_native.head_screen_supported()),
                              reason="the int16 screen needs AVX-512 with VNNI or AVX2")


def assert_screened_equals_greedy_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    vocab = weight.shape[0]
    panels = cpu_native.pack_head_panels(weight)
    codes, stats = cpu_native.pack_head_screen(weight)
    expected = cpu_native.greedy_head(x, panels, vocab)
    tokens, cost = cpu_native.greedy_head_screened(x, panels, codes, stats, vocab)
    assert tokens.dtype == torch.int64
    assert cost >= 0.0
    assert tokens.tolist() == expected.tolist()
    return tokens


@screened
@pytest.mark.parametrize("hidden", [1, 3, 128, 576])
@pytest.mark.parametrize("vocab", [*VOCABS, 4097])
def test_screened_tokens_are_greedy_heads(threads: int, vocab: int, hidden: int) -> None:
    """Rows around the 12-row tile and its tails, vocabularies around the padding, hidden sizes
    odd (a half-filled last pair of codes) and wide (smaller codes: K * max_code^2 < 2^31)."""
    for rows in (*ROWS, 40):
        x, weight = random_case(rows, hidden, vocab, seed=rows * vocab + hidden)
        assert_screened_equals_greedy_head(x, weight)


@screened
def test_screened_near_ties_are_decided_by_the_fp32_logits(threads: int) -> None:
    """Pairs of columns whose logits differ far below the int16 codes' resolution (and exact
    duplicates): the estimates cannot tell them apart, the fp32 recomputation must."""
    generator = torch.Generator().manual_seed(5)
    hidden, vocab = 64, 3000
    weight = torch.randn(vocab, hidden, generator=generator)
    twins = torch.randint(0, vocab, (200,), generator=generator)
    weight[-200:] = weight[twins] * (1 + 1e-6 * torch.randn(200, 1, generator=generator))
    weight[100] = weight[2000]
    x = torch.cat([weight[twins[:40]] * 3, weight[[100, 2000]], torch.randn(20, hidden, generator=generator)])
    assert_screened_equals_greedy_head(x, weight)


@screened
def test_screened_coarse_codes_still_give_greedy_heads(threads: int) -> None:
    """One large activation per row sets its scale, so the other codes keep a few levels each:
    the estimates' order differs from the logits' near the top, and only the bound (not the
    estimates) keeps the winner among the candidates."""
    generator = torch.Generator().manual_seed(9)
    rows, hidden, vocab = 64, 128, 8192
    x, weight = torch.randn(rows, hidden, generator=generator), torch.randn(vocab, hidden, generator=generator)
    x[torch.arange(rows), torch.arange(rows) * 2] = 3000.0
    weight[:, torch.arange(rows) * 2] = 0.0  # (the outliers then move no logit)
    assert_screened_equals_greedy_head(x, weight)


@screened
def test_screened_rows_outside_the_bound_are_computed_exactly(threads: int) -> None:
    """Rows the screen cannot bound (NaN, inf, all zeros, magnitudes that could overflow a logit)
    and a row with more candidates than its list holds (a thousand identical columns) take the
    exact pass; all negative logits never lose to the padding."""
    generator = torch.Generator().manual_seed(6)
    hidden, vocab = 32, 2100
    weight = torch.randn(vocab, hidden, generator=generator)
    weight[1000:2000] = weight[1000]
    x = torch.randn(9, hidden, generator=generator)
    x[0, 3] = float("nan")
    x[1, 4] = float("inf")
    x[2] = 0.0
    x[3] *= 1e30
    x[4] = weight[1000] * 2
    x[5, 0] = 1e4  # one outlier sets the row's scale: its other codes are coarse
    tokens = assert_screened_equals_greedy_head(x, weight)
    assert int(tokens[4]) == 1000
    negative = -weight.abs()
    assert_screened_equals_greedy_head(torch.rand(7, hidden, generator=generator) + 0.5, negative[:33])


@screened
def test_an_lm_head_greedy_path_takes_the_screen() -> None:
    head = ParallelLMHead(300, 24)
    head.weight.data.copy_(torch.randn(300, 24, generator=torch.Generator().manual_seed(7)))
    head.process_weights_after_loading()
    assert head.packed_weight.screen is not None
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(8))
    assert torch.equal(head.greedy_tokens(x), head.compute_logits(x).argmax(dim=-1))
    not_finite = torch.randn(64, 16)
    not_finite[3, 3] = float("inf")
    assert HeadPanels.pack(not_finite).screen is None  # (its codes' scale would be inf)


@screened
def test_a_screen_that_does_not_pay_is_dropped() -> None:
    """Hidden states the bound cannot narrow (every column a candidate: identical columns) cost a
    full recomputation each call: after the trial calls the head drops its screen and takes
    greedy_head; random states keep it. The tokens are greedy_head's throughout."""
    generator = torch.Generator().manual_seed(10)
    weight = torch.randn(4000, 32, generator=generator)
    costly, cheap = HeadPanels.pack(weight.clone()), HeadPanels.pack(weight.clone())
    costly.screen.stats[1:3] *= 1e6  # (widens the bound: every column stays a candidate)
    x = torch.randn(16, 32, generator=generator)
    expected = cpu_native.greedy_head(x, costly.panels, 4000)
    for call in range(SCREEN_TRIAL_CALLS):
        assert costly.screen.active == (call < SCREEN_TRIAL_CALLS)
        assert torch.equal(greedy_tokens(x, costly), expected) and torch.equal(greedy_tokens(x, cheap), expected)
    assert not costly.screen.active and costly.screen.mean_cost > SCREEN_MAX_COST
    assert cheap.screen.active and cheap.screen.mean_cost < SCREEN_MAX_COST
    assert torch.equal(greedy_tokens(x, costly), expected)


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
