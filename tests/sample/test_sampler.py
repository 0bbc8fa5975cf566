"""Acceptance 3 (top-k / top-p / min-p draw from the renormalized distribution: chi-square and
total-variation bounds on 8000 draws per setting, from a fixed seed so it cannot flake), 4 (a seed
gives the same tokens alone, in a mixed batch of 16, and in another order) and the all-greedy
fast path (one argmax, no copy of the logits)."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from llm_factory import make_llm
from sampling_fixtures import make_batch, make_metadata
from vllm_lite import SamplingParams
from vllm_lite import _custom_ops as cpu_native
from vllm_lite.sample.copy_counter import LogitsCopyCounter
from vllm_lite.sample.sampler import Sampler

VOCAB = 40
DRAWS_PER_SET = 8000
TV_BOUND = 0.05  # expected TV at 8000 draws: ~0.01 over 5 tokens, ~0.025 over all 40

PARAM_SETS = [
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
    dict(temperature=1.3),
]


def _fixed_logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> torch.Tensor:
    """transformers' warpers, applied in vLLM's order: temperature, min-p, top-k, top-p."""
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("seeded", [False, True])
def test_truncated_sampling_matches_renormalized_distribution(seeded: bool) -> None:
    """All parameter sets interleaved in one batch: each row uses its own parameters. Seeded:
    each row its own seed, at one of 7 positions (draws keyed by seed and position)."""
    logits = _fixed_logits()
    num_sets = len(PARAM_SETS)
    batch = make_batch([([1] * (1 + i % 7), [], SamplingParams(**PARAM_SETS[i % num_sets], seed=i if seeded else None))
                        for i in range(num_sets * DRAWS_PER_SET)])
    metadata = make_metadata(batch)
    torch.manual_seed(1234)  # unseeded rows draw from torch's global generator: fix it
    sampled = Sampler()(logits.expand(len(batch.live_req_ids), -1).clone(), metadata).sampled_token_ids
    for i, params in enumerate(PARAM_SETS):
        draws = sampled[i::num_sets]
        expected = _reference_probs(logits, **params)
        assert bool((expected[draws] > 0).all()), f"{params}: token outside the allowed set"
        counts = torch.bincount(draws, minlength=VOCAB).double()
        support = expected > 0
        expected_counts = expected.double()[support] * len(draws)
        chi2 = float(((counts[support] - expected_counts) ** 2 / expected_counts).sum())
        dof = int(support.sum()) - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, f"{params}: chi-square {chi2:.1f} with {dof} dof"
        tv = 0.5 * float((counts / len(draws) - expected).abs().sum())
        assert tv < TV_BOUND, f"{params}: total variation {tv:.4f}"
        if params.keys() & {"top_k", "top_p", "min_p"}:
            assert int((expected > 0).sum()) < VOCAB // 2  # the cut did remove tokens


def test_seeded_row_ignores_batch_composition_and_position() -> None:
    logits = _fixed_logits()
    target = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=99)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.2, min_p=0.2, seed=5)]

    def draw(position: int, num_others: int) -> list[int]:
        requests = [([1], [], p) for p in (others * 3)[:num_others]]
        requests.insert(position, ([1], [], target))
        batch = make_batch(requests)
        metadata = make_metadata(batch)
        noise = torch.randn(len(requests), VOCAB)  # other rows see other logits
        noise[position] = 0
        tokens = []
        for _ in range(20):  # each step one position further (the metadata reads the batch's counts)
            tokens.append(int(Sampler()(logits + noise, metadata).sampled_token_ids[position]))
            batch.num_tokens[:len(requests)] += 1
        return tokens

    alone = draw(0, 0)
    assert len(set(alone)) > 1
    assert draw(4, 8) == alone
    assert draw(1, 5) == alone


def test_all_greedy_batch_makes_no_logits_copy() -> None:
    batch = make_batch([([1], [], SamplingParams(temperature=0.0)) for _ in range(8)])
    metadata = make_metadata(batch)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(8, 4096).to(dtype)
        with LogitsCopyCounter(logits) as counter:
            sampled = Sampler()(logits, metadata).sampled_token_ids
        assert counter.num_copies == 0, counter.ops
        assert torch.equal(sampled, logits.argmax(-1))
    top_p = make_metadata(make_batch([([1], [], SamplingParams(top_p=0.9)) for _ in range(8)]))
    with LogitsCopyCounter(logits) as counter:  # the counter does see copies when there are some
        Sampler()(logits, top_p)
    assert counter.num_copies > 0


@pytest.mark.skipif(not cpu_native.is_available(), reason="csrc extension not built")
def test_random_rows_at_temperature_one_make_no_logits_copy() -> None:
    """The OpenAI default (temperature 1.0, no top-k / top-p) divides by nothing and, on CPU,
    copies nothing: the native op draws from the logits as they are."""
    batch = make_batch([([1], [], SamplingParams(temperature=1.0)) for _ in range(8)])
    metadata = make_metadata(batch)
    assert metadata.temperature is None
    logits = torch.randn(8, 4096)
    with LogitsCopyCounter(logits) as counter:
        Sampler()(logits, metadata)
    assert counter.num_copies == 0, counter.ops
    mixed = make_metadata(make_batch([([1], [], SamplingParams(temperature=t)) for t in (1.0, 0.0, 0.5)]))
    assert mixed.temperature is not None and mixed.temperature[:, 0].tolist() == [1.0, 1.0, 0.5]


# ---- end to end: seeds through the engine ----

TARGET = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=16, ignore_eos=True)


def _mixed_requests(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    variants = [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=1.0, max_tokens=12),  # unseeded
        SamplingParams(temperature=0.7, seed=7, max_tokens=16, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.1, seed=8, max_tokens=9, logprobs=3),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=14),
        SamplingParams(temperature=1.1, top_p=0.7, logit_bias={5: 2.0}, max_tokens=11, min_tokens=4),
        SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=5, prompt_logprobs=2),
    ]
    return [(prompts[i % len(prompts)], variants[i % len(variants)]) for i in range(15)]


def _run(llm, requests) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


def test_seed_same_tokens_alone_in_mixed_batch_and_reordered(llm, prompts_token_ids) -> None:
    prompt = prompts_token_ids[3]
    (alone,) = _run(llm, [(prompt, TARGET)])
    assert len(set(alone)) > 4
    mixed = _mixed_requests(prompts_token_ids)
    mixed.insert(5, (prompt, TARGET))
    assert len(mixed) == 16
    assert _run(llm, mixed)[5] == alone
    reordered = list(reversed(mixed))
    assert _run(llm, reordered)[10] == alone
    (other_seed,) = _run(llm, [(prompt, TARGET.clone_with(seed=4321))])
    assert other_seed != alone


def test_seed_survives_preemption_and_chunked_prefill(tiny_llama, llm, prompts_token_ids) -> None:
    """A KV cache too small for the whole batch forces preemptions (the requests recompute)."""
    requests = [(prompts_token_ids[i], TARGET.clone_with(seed=100 + i, max_tokens=24)) for i in range(3, 8)]
    expected = [_run(llm, [r])[0] for r in requests]
    small = make_llm(tiny_llama, num_kv_blocks=24, block_size=8, max_num_batched_tokens=32)
    assert _run(small, requests) == expected
    assert small.stats()["num_preemptions"] > 0


def test_logprobs_computed_only_for_rows_that_asked() -> None:
    asked = {1: 0, 4: 3, 6: 2}  # row -> logprobs
    batch = make_batch([([1], [], SamplingParams(temperature=0.0, logprobs=asked.get(row)))
                        for row in range(8)])
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    with LogitsCopyCounter(logits) as counter:
        out = Sampler()(logits, make_metadata(batch))
    assert out.logprobs_rows.tolist() == sorted(asked)
    assert counter.num_copies == 0, counter.ops  # log_softmax ran on the 3 rows only
    full = logits.log_softmax(-1)
    assert out.logprobs.logprobs.shape == (3, 4)
    for i, row in enumerate(sorted(asked)):
        chosen = int(out.sampled_token_ids[row])
        assert int(out.logprobs.token_ids[i, 0]) == chosen
        torch.testing.assert_close(out.logprobs.logprobs[i, 0], full[row, chosen])
        torch.testing.assert_close(out.logprobs.logprobs[i, 1:], full[row].topk(3).values)
