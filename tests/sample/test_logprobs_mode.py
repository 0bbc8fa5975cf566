"""vLLM's logprobs_mode: sampled logprobs of the model's distribution (raw_logprobs, the default)
or its logits (raw_logits), or of the distribution the token is drawn from (processed_logprobs)
or its logits (processed_logits): after logit_bias / penalties, and for random rows temperature
and the top-k / top-p truncation (-inf outside). The sampled tokens do not depend on the mode.
Checked on the sampler with hand-made logits, and end to end against transformers' logits."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from hf_reference import hf_logits
from llm_factory import make_llm
from sampling_fixtures import make_batch, make_metadata
from vllm_lite import SamplingParams
from vllm_lite.config import LOGPROBS_MODES, EngineArgs
from vllm_lite.entrypoints.cli_args import add_engine_args, engine_args_from
from vllm_lite.sample.ops.topk_topp import mask_top_k_top_p
from vllm_lite.sample.sampler import Sampler

VOCAB, K = 40, 3


def mixed_batch():
    params = [SamplingParams(temperature=0.0, logprobs=K),
              SamplingParams(temperature=0.5, top_k=5, seed=1, logprobs=K),
              SamplingParams(temperature=1.0, top_p=0.6, seed=2, logprobs=K)]
    batch = make_batch([([1, 2], [], p) for p in params])
    return batch, make_metadata(batch)


def expected_processed_logits(raw: torch.Tensor) -> torch.Tensor:
    """Row 0 greedy in a mixed batch: temperature 1; row 1: /0.5, top-5; row 2: top-p 0.6."""
    logits = raw.clone()
    logits[1] /= 0.5
    mask_top_k_top_p(logits, torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.6]))
    return logits


def values_of(output, row: int) -> dict[int, float]:
    logprobs = output.logprobs
    return dict(zip(logprobs.token_ids[row].tolist(), logprobs.logprobs[row].tolist()))


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_each_mode_reports_its_values_and_samples_the_same_tokens(mode: str) -> None:
    raw = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    expected = {"raw_logprobs": raw.log_softmax(-1), "raw_logits": raw,
                "processed_logits": expected_processed_logits(raw),
                "processed_logprobs": expected_processed_logits(raw).log_softmax(-1)}[mode]
    _, metadata = mixed_batch()
    output = Sampler(mode)(raw.clone(), metadata)
    _, reference_metadata = mixed_batch()
    assert torch.equal(output.sampled_token_ids, Sampler()(raw.clone(), reference_metadata).sampled_token_ids)
    for row in range(3):
        values = values_of(output, row)
        assert len(values) == K + (int(output.sampled_token_ids[row]) not in values)
        for token_id, value in values.items():
            assert value == pytest.approx(float(expected[row, token_id]), abs=1e-5), (mode, row, token_id)


def test_processed_values_of_an_all_greedy_batch_follow_the_bias() -> None:
    raw = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.0, logprobs=K, logit_bias={7: 50.0})
    for mode, expected in (("processed_logits", 50.0 + raw[0, 7]), ("raw_logits", raw[0, 7])):
        output = Sampler(mode)(raw.clone(), make_metadata(make_batch([([1], [], params)])))
        assert int(output.sampled_token_ids[0]) == 7
        assert values_of(output, 0)[7] == pytest.approx(float(expected), abs=1e-5)


def test_modes_are_checked_and_flagged(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(model=str(tiny_llama), logprobs_mode="final").create_engine_config()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--model", str(tiny_llama), "--logprobs-mode", "raw_logits"]))
    assert args.create_engine_config().model_config.logprobs_mode == "raw_logits"


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_engine_logprobs_follow_the_mode_against_transformers(tiny_llama: Path, mode: str) -> None:
    prompt = [1, 5, 9, 14, 3]
    llm = make_llm(tiny_llama, logprobs_mode=mode)
    try:
        params = SamplingParams(temperature=0.7, top_k=4, seed=3, max_tokens=4, logprobs=2, ignore_eos=True)
        completion = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    logits = hf_logits(tiny_llama, prompt + list(completion.token_ids))[len(prompt) - 1:-1]
    for step, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = logits[step].clone()
        if mode == "processed_logprobs":
            row /= 0.7
            mask_top_k_top_p(row[None], torch.tensor([4]), torch.tensor([1.0]))
            row = row.log_softmax(-1)
        assert entry[token_id].logprob == pytest.approx(float(row[token_id]), abs=1e-4), (step, mode)
