"""Acceptance 1: repetition/frequency/presence penalties, logit_bias and min_tokens match a
reference built from transformers' own logits processors (the OpenAI formula for frequency and
presence, which transformers lacks), on the same logits; and greedy decoding with them matches
transformers end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (AutoModelForCausalLM, GenerationConfig, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from hf_reference import hf_logits
from llm_factory import make_llm
from sampling_fixtures import make_batch, make_metadata
from vllm_lite import SamplingParams
from vllm_lite.sample.ops.logits_bias import apply_logit_bias, apply_min_tokens
from vllm_lite.sample.occurrences import TokenOccurrences
from vllm_lite.sample.ops.penalties import apply_penalties
from vllm_lite.sample.sampler import Sampler
from vllm_lite.worker.sampling_inputs import build_sampling_metadata

VOCAB = 64


def _history(seed: int, num_prompt: int, num_output: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # A small id range so tokens repeat (counts > 1) and overlap between prompt and output.
    prompt = torch.randint(0, 24, (num_prompt,), generator=gen).tolist()
    output = torch.randint(8, 32, (num_output,), generator=gen).tolist()
    return prompt, output


def _logits(num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def _hf_repetition(logits: torch.Tensor, prompt: list[int], output: list[int], penalty: float) -> torch.Tensor:
    input_ids = torch.tensor([prompt + output])
    return RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits[None].clone())[0]


def _openai_frequency_presence(logits: torch.Tensor, output: list[int], frequency: float,
                               presence: float) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    return logits - frequency * counts - presence * (counts > 0).float()


ROWS = [  # (repetition, frequency, presence, num_prompt, num_output)
    (1.3, 0.0, 0.0, 10, 6),
    (1.0, 0.7, 0.0, 5, 12),
    (1.0, 0.0, -1.2, 7, 3),
    (1.0, 0.0, 0.0, 9, 4),  # no penalty: must stay untouched
    (0.8, 1.5, 0.5, 12, 9),
    (2.0, -0.4, 1.9, 3, 0),  # nothing generated yet: only the prompt counts (repetition)
]


@pytest.mark.parametrize("subset", [False, True], ids=["mixed-rows", "all-rows-penalized"])
def test_penalties_match_transformers(subset: bool) -> None:
    rows = [r for r in ROWS if r[:3] != (1.0, 0.0, 0.0)] if subset else ROWS
    histories = [_history(i, r[3], r[4]) for i, r in enumerate(rows)]
    batch = make_batch([(p, o, SamplingParams(temperature=0.0, repetition_penalty=r[0], frequency_penalty=r[1],
                                              presence_penalty=r[2])) for (p, o), r in zip(histories, rows)])
    metadata = make_metadata(batch)
    assert metadata.penalties is not None and metadata.penalties.all_rows == subset
    logits = _logits(len(rows))
    expected = []
    for row, ((prompt, output), (rep, freq, pres, _, _)) in enumerate(zip(histories, rows)):
        ref = _hf_repetition(logits[row], prompt, output, rep)
        expected.append(_openai_frequency_presence(ref, output, freq, pres))
    apply_penalties(logits, metadata.penalties)
    torch.testing.assert_close(logits, torch.stack(expected), rtol=0, atol=1e-5)


def test_repetition_penalty_sees_tokens_appended_after_metadata_was_built() -> None:
    """The metadata is cached across decode steps; the token history it reads must be live."""
    prompt, output = [1, 2, 3], [4]
    batch = make_batch([(prompt, output, SamplingParams(repetition_penalty=1.5))])
    metadata = make_metadata(batch)
    batch.token_ids[0, batch.num_tokens[0]] = 9  # the sampler appends a token
    batch.num_tokens[0] += 1
    logits = _logits(1)
    expected = _hf_repetition(logits[0], prompt, output + [9], 1.5)
    apply_penalties(logits, metadata.penalties)
    torch.testing.assert_close(logits[0], expected, rtol=0, atol=1e-6)


def test_occurrences_kept_incrementally_across_steps_and_rebuilt_after_release() -> None:
    """Steady decode: the state counts only the tokens added since the last step (rewriting an
    already-counted token changes nothing), and a released request is rebuilt from its history."""
    histories = [_history(20 + i, 6 + i, 2) for i in range(3)]
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3)
    batch = make_batch([(p, o, params) for p, o in histories])
    occurrences = TokenOccurrences(torch.device("cpu"))
    rows = np.arange(3)
    metadata = build_sampling_metadata(batch, rows, {}, torch.device("cpu"), occurrences)
    for step in range(5):
        for row, (prompt, output) in enumerate(histories):
            token = (7 * step + row) % 40
            output.append(token)
            batch.token_ids[row, batch.num_tokens[row]] = token
            batch.num_tokens[row] += 1
        logits = _logits(3)
        apply_penalties(logits, metadata.penalties)
        expected = torch.stack([_openai_frequency_presence(_hf_repetition(_logits(3)[row], p, o, 1.4), o, 0.6, 0.3)
                                for row, (p, o) in enumerate(histories)])
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    batch.token_ids[0, 0] = 63  # already counted: the incremental state does not read it again
    before = _logits(3)
    apply_penalties(before, metadata.penalties)
    torch.testing.assert_close(before, expected, rtol=0, atol=1e-5)
    occurrences.release("r0")  # as on preemption: the next use rebuilds r0 from its history
    rebuilt = _logits(3)
    apply_penalties(rebuilt, metadata.penalties)
    prompt0, output0 = histories[0]
    fresh = _hf_repetition(_logits(3)[0], [63] + prompt0[1:], output0, 1.4)
    torch.testing.assert_close(rebuilt[0], _openai_frequency_presence(fresh, output0, 0.6, 0.3), rtol=0, atol=1e-5)


def test_logit_bias_matches_sequence_bias_processor() -> None:
    biases = [{3: 5.0, 17: -2.5}, None, {0: 100.0, 63: -100.0, 5: 0.25}]
    batch = make_batch([([1, 2], [], SamplingParams(logit_bias=b)) for b in biases])
    metadata = make_metadata(batch)
    logits = _logits(len(biases))
    expected = logits.clone()
    for row, bias in enumerate(biases):
        if bias:
            processor = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])
            expected[row] = processor(torch.tensor([[1, 2]]), logits[row][None].clone())[0]
    apply_logit_bias(logits, metadata.logit_bias)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_min_tokens_matches_min_new_tokens_processor() -> None:
    eos, stop = (2, 0), (11,)
    cases = [(3, 0), (3, 2), (3, 3), (5, 4), (0, 0)]  # (min_tokens, outputs so far)
    requests = [([5, 6, 7], list(range(20, 20 + num_out)), SamplingParams(min_tokens=min_tokens, stop_token_ids=[11]))
                for min_tokens, num_out in cases]
    batch = make_batch(requests)
    metadata = make_metadata(batch, stop_ids={f"r{row}": eos + stop for row in range(len(cases))})
    logits = _logits(len(cases))
    expected = logits.clone()
    for row, (min_tokens, num_out) in enumerate(cases):
        processor = MinNewTokensLengthLogitsProcessor(3, min_tokens, list(eos + stop))
        expected[row] = processor(torch.tensor([requests[row][0] + requests[row][1]]), logits[row][None].clone())[0]
    apply_min_tokens(logits, metadata.min_tokens)
    assert torch.equal(logits, expected)


def test_greedy_sampler_applies_bias_then_penalties() -> None:
    """vLLM's order: logit_bias before the (multiplicative) repetition penalty."""
    prompt, output = [4, 9], [9]
    batch = make_batch([(prompt, output, SamplingParams(temperature=0.0, repetition_penalty=2.0,
                                                        logit_bias={9: 3.0}))])
    logits = _logits(1)
    biased = SequenceBiasLogitsProcessor([[[9], 3.0]])(torch.tensor([prompt + output]), logits.clone())
    expected = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([prompt + output]), biased)
    sampled = Sampler()(logits.clone(), make_metadata(batch)).sampled_token_ids
    assert sampled.tolist() == expected.argmax(-1).tolist()


# ---- end to end: greedy decoding with penalties / bias equals transformers' generate ----

PROMPT_INDEX = (1, 4)  # a 7-token and a 33-token prompt
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_generate(model, prompt: list[int], **generation_kwargs) -> list[int]:
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                              **generation_kwargs)
    input_ids = torch.tensor([prompt])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def _generate(llm, prompts, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_repetition_penalty_greedy_matches_hf_generate(llm, hf_model, prompts_token_ids) -> None:
    prompts = [prompts_token_ids[i] for i in PROMPT_INDEX]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.8)
    expected = [_hf_generate(hf_model, p, repetition_penalty=1.8) for p in prompts]
    assert _generate(llm, prompts, params) == expected
    assert _generate(llm, prompts, params.clone_with(repetition_penalty=1.0)) != expected  # it mattered


def test_logit_bias_greedy_matches_hf_sequence_bias(llm, hf_model, prompts_token_ids) -> None:
    prompts = [prompts_token_ids[i] for i in PROMPT_INDEX]
    bias = {293: 4.0, 14: 3.5, 347: -50.0}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias)
    expected = [_hf_generate(hf_model, p, sequence_bias=[[[t], v] for t, v in bias.items()]) for p in prompts]
    assert _generate(llm, prompts, params) == expected
    assert _generate(llm, prompts, params.clone_with(logit_bias=None)) != expected  # it mattered


def test_frequency_presence_greedy_matches_openai_formula(llm, tiny_llama, prompts_token_ids) -> None:
    prompt = prompts_token_ids[3]  # its greedy continuation repeats tokens within MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.8, repetition_penalty=1.2)
    output: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = hf_logits(tiny_llama, prompt + output)[-1]
        logits = _hf_repetition(logits, prompt, output, 1.2)
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(logits)).float()
        logits = logits - 1.5 * counts - 0.8 * (counts > 0).float()
        output.append(int(logits.argmax()))
    assert _generate(llm, [prompt], params) == [output]
    assert _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)) != [output]


def test_penalties_survive_preemption_and_chunked_prefill(tiny_llama, llm, prompts_token_ids) -> None:
    """Preempted requests drop their occurrence rows and rebuild them when they come back."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.7, presence_penalty=0.4)
    prompts = [prompts_token_ids[i] for i in range(3, 8)]
    expected = [_generate(llm, [p], params)[0] for p in prompts]
    small = make_llm(tiny_llama, num_kv_blocks=24, block_size=8, max_num_batched_tokens=32)
    assert _generate(small, prompts, params) == expected
    assert small.stats()["num_preemptions"] > 0
