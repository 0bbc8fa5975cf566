"""vLLM's n-gram speculative decoding (speculative_config={"method": "ngram", ...}).

The model is a tiny Llama made to follow short cycles of tokens (its LM head maps each token's
embedding to the next token of a 7-token cycle) with its blocks scaled down, not off: the context
still moves its choices, so greedy runs walk the cycles (the drafts, taken from earlier in the
sequence, are mostly right) and leave them now and then (a draft is wrong and the step's own
token is taken). Outputs must be the very tokens decoding without drafts gives (and transformers'
greedy ones), stops inside kept drafts included; sampled tokens must follow the model's
distribution (checked against the exact one, on the blocks-off model where it is a bigram)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import build_cycling_model, hf_greedy
from llm_factory import make_llm
from vllm_lite import AsyncLLM, EngineArgs, SamplingParams
from vllm_lite.entrypoints.beam_search import BeamSearchParams
from vllm_lite.exceptions import RequestRejectedError
from vllm_lite.core.ngram_proposer import propose_ngram
from vllm_lite.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm_lite.wire import EngineCoreOutputs, FinishedRequest, FinishReason, split_token_columns

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
PROMPTS = [{"prompt_token_ids": list(range(10 + 7 * i, 30 + 7 * i))} for i in range(6)]


@pytest.fixture(scope="module")
def cycling_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("cycling"), 0.05)


@pytest.fixture(scope="module")
def bigram_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("bigram"), 0.0, head_scale=1.2, cycle_length=3)


def _token_ids(llm, prompts, params) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]


def _spec_metrics(llm) -> dict[str, object]:
    return {metric.name: metric for metric in llm.get_metrics() if metric.name.startswith("vllm:spec_decode")}


@pytest.fixture(scope="module")
def greedy_reference(cycling_model: Path) -> list[list[int]]:
    llm = make_llm(cycling_model)
    return _token_ids(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))


# ---- the proposer ----
@pytest.mark.parametrize("tokens, min_n, max_n, k, draft", [
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),
    ([1, 2, 3, 4, 5], 1, 4, 3, []),  # no earlier occurrence of any suffix
    ([1, 2, 3, 4, 5, 1], 1, 4, 3, [2, 3, 4]),
    ([1, 2, 3, 4, 5, 1, 2], 1, 4, 3, [3, 4, 5]),
    ([1, 2, 3, 4, 5, 1, 2, 3], 1, 4, 3, [4, 5, 1]),
    ([9, 1, 2, 7, 3, 1, 2, 8, 3, 1, 2], 2, 3, 2, [8, 3]),  # the longest suffix wins over an earlier shorter one
    ([1, 2, 9, 1, 2, 7, 3, 1, 2], 1, 3, 2, [9, 1]),  # among equally long ones, the earliest
    ([5, 5, 5, 5], 2, 3, 4, [5]),  # the draft stops at the sequence's end
    ([1, 2, 3, 1, 2], 3, 3, 2, []),  # shorter than min_n matches do not count
    ([4, 1, 2, 3], 1, 1, 2, []),
])
def test_ngram_proposals(tokens: list[int], min_n: int, max_n: int, k: int, draft: list[int]) -> None:
    assert propose_ngram(np.array(tokens, dtype=np.int32), min_n, max_n, k).tolist() == draft


def test_ngram_proposal_matches_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).astype(np.int32)
        min_n, k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        max_n = min_n + int(rng.integers(0, 3))
        expected: list[int] = []
        for n in range(max_n, min_n - 1, -1):  # longest first, then the earliest start
            starts = [i for i in range(len(tokens) - n) if n <= len(tokens) - 1
                      and (tokens[i:i + n] == tokens[len(tokens) - n:]).all()]
            if starts:
                expected = tokens[starts[0] + n:starts[0] + n + k].tolist()
                break
        assert propose_ngram(tokens, min_n, max_n, k).tolist() == expected, (tokens.tolist(), min_n, max_n, k)


# ---- greedy: the tokens of decoding without drafts ----
def test_greedy_tokens_equal_decoding_without_drafts_and_transformers(cycling_model: Path,
                                                                      greedy_reference: list[list[int]]) -> None:
    llm = make_llm(cycling_model, speculative_config=NGRAM, disable_log_stats=False)
    assert _token_ids(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)) == greedy_reference
    metrics = _spec_metrics(llm)
    accepted, drafted = metrics["vllm:spec_decode_num_accepted_tokens"].value, metrics["vllm:spec_decode_num_draft_tokens"].value
    assert 0 < accepted < drafted  # drafts were kept, and some were not
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_position) == 4 and sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert metrics["vllm:spec_decode_num_drafts"].value > 0
    # one inter-token latency per step and request (vLLM's count), not one per kept draft
    latencies = {m.name: m for m in llm.get_metrics()}["vllm:inter_token_latency_seconds"].count
    assert 0 < latencies <= len(PROMPTS) * 99 - accepted
    prompts = [prompt["prompt_token_ids"] for prompt in PROMPTS[:2]]
    assert hf_greedy(cycling_model, prompts, 100) == greedy_reference[:2]


def test_the_stats_line_reports_the_drafts(cycling_model: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's "SpecDecoding metrics" line after the stats line: the lines' counts add up to the
    metrics' (but for the last steps', whose line is not due yet)."""
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.001")
    llm = make_llm(cycling_model, speculative_config=NGRAM, disable_log_stats=False)
    with caplog.at_level(logging.INFO):
        _token_ids(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding metrics: ")]
    assert lines
    pattern = re.compile(r"Mean acceptance length: [\d.]+, Accepted throughput: [\d.]+ tokens/s, Drafted throughput: "
                         r"[\d.]+ tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) tokens, Per-position acceptance "
                         r"rate: [\d., ]+, Avg Draft acceptance rate: [\d.]+%$")
    counts = [pattern.search(line) for line in lines]
    assert all(counts), lines[0]
    metrics = _spec_metrics(llm)
    accepted, drafted = sum(int(m.group(1)) for m in counts), sum(int(m.group(2)) for m in counts)
    assert 0 < accepted <= metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert accepted < drafted <= metrics["vllm:spec_decode_num_draft_tokens"].value


@pytest.mark.parametrize("engine_args", [
    {"speculative_config": {**NGRAM, "num_speculative_tokens": 1}},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1}},
    # a token budget that cuts drafts short, chunked prompts beside drafting requests
    {"speculative_config": NGRAM, "max_num_batched_tokens": 9},
    # KV blocks for a few requests only: drafting requests are preempted and resume
    {"speculative_config": NGRAM, "block_size": 16, "num_kv_blocks": 20, "enable_prefix_caching": False},
    {"speculative_config": {**NGRAM, "disable_by_batch_size": 3}},
    {"speculative_config": {"model": "[ngram]", "num_speculative_tokens": 3}},  # vLLM's older spelling
    # the other attention backends (a drafted request's query is several tokens, as a prompt chunk's)
    {"speculative_config": NGRAM, "attention_backend": "torch"},
    {"speculative_config": NGRAM, "attention_backend": "triton", "block_size": 16, "shorter": True},
    {"speculative_config": NGRAM, "dtype": "bfloat16", "reference_dtype": "bfloat16"},
])
def test_greedy_tokens_under_every_schedule(cycling_model: Path, greedy_reference: list[list[int]],
                                            engine_args: dict) -> None:
    engine_args = dict(engine_args)
    reference_dtype = engine_args.pop("reference_dtype", None)
    if reference_dtype is not None and torch.cuda.is_available():
        pytest.skip("bf16 on CUDA: cuBLAS rounds a drafted step's several rows otherwise than one decode row")
    # Triton's interpreter: 1 prompt, 20 tokens (drafts from about the 9th token on; 53 s with two
    # prompts on a slow 2-vCPU Xeon, a tenth of the suite's longest file)
    prompts, max_tokens = (PROMPTS[:1], 20) if engine_args.pop("shorter", False) else (PROMPTS, 100)
    llm = make_llm(cycling_model, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if reference_dtype is not None:  # (bf16 rounds otherwise than fp32: decoding without drafts in bf16)
        greedy_reference = _token_ids(make_llm(cycling_model, dtype=reference_dtype), prompts, params)
    expected = [tokens[:max_tokens] for tokens in greedy_reference[:len(prompts)]]
    assert _token_ids(llm, prompts, params) == expected
    if "num_kv_blocks" in engine_args:
        assert llm.stats()["num_preemptions"] > 0
    assert _token_ids(llm, prompts[:2], params) == expected[:2]  # prefix-cache hits where cached


def test_prefix_cache_keeps_only_kept_tokens(cycling_model: Path, greedy_reference: list[list[int]]) -> None:
    """A finished request's blocks are cached with its kept tokens, never a rejected draft's:
    a prompt made of a finished sequence finds them and goes on as decoding it whole would."""
    llm = make_llm(cycling_model, speculative_config=NGRAM, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    first = _token_ids(llm, PROMPTS[:1], params)[0]
    continued = {"prompt_token_ids": PROMPTS[0]["prompt_token_ids"] + first[:64]}
    plain = make_llm(cycling_model, block_size=16)
    expected = _token_ids(plain, [continued], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    output = llm.generate([continued], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert output.num_cached_tokens >= 64
    assert list(output.outputs[0].token_ids) == expected[0]


# ---- stops inside kept drafts ----
@pytest.mark.parametrize("stop_kind", ["stop_token_ids", "max_tokens", "stop", "min_tokens"])
def test_stops_inside_kept_drafts(cycling_model: Path, greedy_reference: list[list[int]], stop_kind: str) -> None:
    """A stop condition met by a kept draft ends the request there, as decoding without drafts
    would: the same tokens, text, finish reason and stop reason."""
    cycle_token = greedy_reference[0][40]  # a token of the cycle the first prompt walks
    params = {
        "stop_token_ids": dict(temperature=0, max_tokens=100, ignore_eos=True, stop_token_ids=[cycle_token]),
        "max_tokens": dict(temperature=0, max_tokens=43, ignore_eos=True),
        "stop": dict(temperature=0, max_tokens=100, ignore_eos=True),
        # (before min_tokens the stop token is masked: the run leaves the cycle there, and meets it later)
        "min_tokens": dict(temperature=0, max_tokens=100, ignore_eos=True, stop_token_ids=[cycle_token],
                           min_tokens=greedy_reference[0].index(cycle_token) + 1),
    }[stop_kind]
    plain, spec = make_llm(cycling_model), make_llm(cycling_model, speculative_config=NGRAM)
    if stop_kind == "stop":
        text = plain.generate(PROMPTS[:1], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
        params["stop"] = [text[len(text) * 2 // 3:len(text) * 2 // 3 + 3]]
    expected = plain.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    got = spec.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    for want, have in zip(expected, got):
        a, b = want.outputs[0], have.outputs[0]
        assert (list(b.token_ids), b.text, b.finish_reason, b.stop_reason) == \
               (list(a.token_ids), a.text, a.finish_reason, a.stop_reason)
    assert expected[0].outputs[0].finish_reason == ("length" if stop_kind == "max_tokens" else "stop")


def test_min_tokens_counts_the_drafts_before_each_position(cycling_model: Path,
                                                            greedy_reference: list[list[int]]) -> None:
    """A request with min_tokens drafts from the start: at each draft position its stop tokens
    are masked while the outputs so far (the drafts before it included) are fewer than
    min_tokens. A sweep puts the boundary everywhere: each prompt, stop tokens taken along its
    run, min_tokens values up to the stop token's first place (where the mask decides whether
    the run stops there, inside a step of kept drafts in some of them)."""
    prompts, params = [], []
    for prompt, tokens in zip(PROMPTS, greedy_reference):
        for stop_token in tokens[10:90:8]:
            first = tokens.index(stop_token)
            for min_tokens in range(max(1, first - 4), first + 1):
                prompts.append(prompt)
                params.append(SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                                             stop_token_ids=[stop_token], min_tokens=min_tokens))
    expected = make_llm(cycling_model).generate(prompts, params, use_tqdm=False)
    spec = make_llm(cycling_model, speculative_config=NGRAM, disable_log_stats=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert (list(have.outputs[0].token_ids), have.outputs[0].finish_reason) == \
               (list(want.outputs[0].token_ids), want.outputs[0].finish_reason)
    assert _spec_metrics(spec)["vllm:spec_decode_num_accepted_tokens"].value > 1000


# ---- sampling ----
def test_sampled_tokens_follow_the_models_distribution(bigram_model: Path) -> None:
    """On the blocks-off model the next token's distribution depends on the last token alone:
    P(y | x) = softmax(logits(x)), known exactly. Kept drafts must not shift it: the share of
    sampled transitions that go to the cycle's next token (the draft's usual guess) is within
    4.5 standard deviations of its expectation given the tokens they came from."""
    temperature = 1.0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bigram_model, dtype=torch.float32)
    vocab = hf.config.vocab_size
    with torch.inference_mode():
        logits = hf(input_ids=torch.arange(vocab)[:, None]).logits[:, 0, :]
    probs = torch.softmax(logits, dim=-1).numpy()
    mode = probs.argmax(axis=1)
    llm = make_llm(bigram_model, speculative_config={**NGRAM, "prompt_lookup_min": 1}, disable_log_stats=False)
    prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(5, vocab, 24)]} for i in range(96)]
    outputs = llm.generate(prompts, [SamplingParams(temperature=temperature, max_tokens=48, ignore_eos=True, seed=i)
                                     for i in range(96)], use_tqdm=False)
    previous = np.concatenate([np.array(p["prompt_token_ids"][-1:] + list(o.outputs[0].token_ids)[:-1])
                               for p, o in zip(prompts, outputs)])
    sampled = np.concatenate([np.array(o.outputs[0].token_ids) for o in outputs])
    p_mode = probs[previous, mode[previous]]
    observed, expected = float((sampled == mode[previous]).sum()), float(p_mode.sum())
    deviation = (observed - expected) / np.sqrt((p_mode * (1 - p_mode)).sum())
    assert abs(deviation) < 4.5, (observed, expected, deviation)
    assert 0.5 < p_mode.mean() < 0.95  # (the model's margins leave the draft right often, not always)
    assert _spec_metrics(llm)["vllm:spec_decode_num_accepted_tokens"].value > 500


def test_seeded_sampling_repeats(cycling_model: Path) -> None:
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=60, ignore_eos=True, seed=i)
              for i in range(len(PROMPTS))]
    llm = make_llm(cycling_model, speculative_config=NGRAM)
    first = _token_ids(llm, PROMPTS, params)
    assert _token_ids(llm, PROMPTS[::-1], params[::-1]) == first[::-1]


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 9},  # drafts cut short by the budget
    {"block_size": 16, "num_kv_blocks": 20, "enable_prefix_caching": False},  # preempted and resumed
])
def test_seeded_samples_equal_decoding_without_drafts(bigram_model: Path, engine_args: dict) -> None:
    """A seeded request draws by position (sample/seeded_draws.py) and every drafted position
    samples as a plain step would: its tokens are those decoding without drafts gives, whatever
    drafts were proposed, cut or rejected (the bigram model keeps a draft about 70% of the time)."""
    vocab = 64
    prompts = [{"prompt_token_ids": [int(t) for t in np.random.default_rng(i).integers(5, vocab, 24)]}
               for i in range(6)]
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=60, ignore_eos=True, seed=i,
                             repetition_penalty=1.1 if i % 2 else 1.0) for i in range(len(prompts))]
    params.append(SamplingParams(n=3, temperature=1.0, max_tokens=40, ignore_eos=True, seed=-11))
    prompts.append(prompts[0])
    plain = make_llm(bigram_model)
    spec = make_llm(bigram_model, speculative_config={**NGRAM, "prompt_lookup_min": 1}, disable_log_stats=False,
                    **engine_args)

    def samples(llm) -> list[list[list[int]]]:
        return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    expected = samples(plain)
    assert len({tuple(tokens) for tokens in expected[-1]}) == 3  # (the n samples are not one another's copies)
    assert samples(spec) == expected
    metrics = _spec_metrics(spec)
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    assert 0 < accepted < metrics["vllm:spec_decode_num_draft_tokens"].value  # drafts kept and rejected
    if "num_kv_blocks" in engine_args:
        assert spec.stats()["num_preemptions"] > 0


def test_requests_that_cannot_draft_decode_beside_those_that_do(cycling_model: Path,
                                                                greedy_reference: list[list[int]]) -> None:
    """Bad words depend on every token before: those requests get no drafts
    (and the tokens of decoding without them), while others in the same steps do, with their
    logit bias, allowed tokens and prompt logprobs."""
    plain, spec = make_llm(cycling_model), make_llm(cycling_model, speculative_config=NGRAM, disable_log_stats=False)
    special = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, bad_words=["zzz"]),
               SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, bad_words=["a b"]),
               SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, bad_words=["the"]),
               SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))]
    # these draft: their sampling at a position does not depend on the tokens before it
    drafting = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                               logit_bias={greedy_reference[5][50]: -100.0}, prompt_logprobs=1),
                SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                               allowed_token_ids=sorted(set(greedy_reference[4])))]
    prompts, params = PROMPTS + PROMPTS[:1], special[:3] + drafting + special[3:]
    expected, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert (list(have.outputs[0].token_ids), have.outputs[0].text) == \
               (list(want.outputs[0].token_ids), want.outputs[0].text)
    assert got[4].prompt_logprobs == expected[4].prompt_logprobs
    assert list(got[3].outputs[0].token_ids) == greedy_reference[3]
    assert set(got[5].outputs[0].token_ids) <= set(greedy_reference[4])
    assert _spec_metrics(spec)["vllm:spec_decode_num_accepted_tokens"].value > 0


@pytest.mark.parametrize("penalties", [{"frequency_penalty": 2.0}, {"presence_penalty": 1.5, "frequency_penalty": 0.5},
                                       {"repetition_penalty": 1.2}])
def test_penalties_count_the_drafts_before_each_position(bigram_model: Path, penalties: dict) -> None:
    """A penalized request drafts too: at each draft position the drafts before it count as its
    outputs (the penalties there are those decoding a token a step would apply: the processed
    logprobs, penalties applied, are the same at every position; the bigram model's margins are
    small enough for the penalties to move them)."""
    params = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=2, **penalties)
              for _ in PROMPTS]
    expected = make_llm(bigram_model, logprobs_mode="processed_logprobs").generate(PROMPTS, params, use_tqdm=False)
    spec = make_llm(bigram_model, speculative_config=NGRAM, disable_log_stats=False, logprobs_mode="processed_logprobs")
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert list(have.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert list(a) == list(b)
            assert np.allclose([x.logprob for x in b.values()], [x.logprob for x in a.values()], atol=1e-4)
    assert _spec_metrics(spec)["vllm:spec_decode_num_accepted_tokens"].value > 50


def test_grammars_constrain_every_draft_position(cycling_model: Path) -> None:
    """A constrained request drafts too: its drafts are cut where its grammar would not accept
    them, each draft position samples under the grammar's state after the drafts before it (a
    bitmask row per position), and its matcher advances through the kept tokens: the tokens of
    decoding without drafts, whole JSON values included."""
    constraints = [StructuredOutputsParams(regex="(ab|cd|ef)+"), StructuredOutputsParams(regex="[a-z ]+"),
                   StructuredOutputsParams(json={"type": "object", "required": ["a"],
                                                 "properties": {"a": {"type": "array", "items": {"type": "integer"}}}})]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint)
              for constraint in constraints for _ in range(2)]
    prompts = PROMPTS[:2] * len(constraints)
    expected = make_llm(cycling_model).generate(prompts, params, use_tqdm=False)
    spec = make_llm(cycling_model, speculative_config={**NGRAM, "prompt_lookup_min": 1}, disable_log_stats=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert (list(have.outputs[0].token_ids), have.outputs[0].text, have.outputs[0].finish_reason) == \
               (list(want.outputs[0].token_ids), want.outputs[0].text, want.outputs[0].finish_reason)
    assert got[-1].outputs[0].text.lstrip().startswith("{")
    assert _spec_metrics(spec)["vllm:spec_decode_num_accepted_tokens"].value > 100


def test_a_position_left_without_a_token_fails_its_request_where_it_is_reached(
        cycling_model: Path, greedy_reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """allowed_token_ids ["a"] with a grammar "a{3}b": the 4th position has nothing left to
    sample. With drafts ("a" after "a", cut by the grammar after the third) that position is a
    draft position of a step whose drafts before it are kept: the request fails there, as without
    drafts, and the request drafting beside it keeps the tokens decoding without drafts gives."""
    import vllm_lite.worker.model_runner as model_runner

    reached: list[tuple[list[int], list[int]]] = []
    fail_emptied_kept = model_runner.ModelRunner._fail_emptied_kept

    def spy(self, logits_rows, positions, emptied, output):
        reached.append((positions[emptied].tolist(), output.num_sampled[logits_rows[emptied]].tolist()))
        return fail_emptied_kept(self, logits_rows, positions, emptied, output)

    monkeypatch.setattr(model_runner.ModelRunner, "_fail_emptied_kept", spy)
    llm = make_llm(cycling_model, speculative_config={**NGRAM, "prompt_lookup_min": 1})
    token_a = llm.get_tokenizer().convert_tokens_to_ids("a")
    engine = llm.llm_engine
    engine.add_request("poison", {"prompt_token_ids": [token_a] * 6 + list(range(10, 20)) + [token_a] * 6},
                       SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[token_a],
                                      structured_outputs=StructuredOutputsParams(regex="a{3}b")))
    engine.add_request("plain", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    finished, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            finished.update((out.request_id, list(out.outputs[0].token_ids)) for out in engine.step() if out.finished)
        except RequestRejectedError as exc:
            errors.append(exc)
    assert [e.request_id for e in errors] == ["poison"] and "exclude every token" in str(errors[0])
    assert finished == {"plain": greedy_reference[0][:30]}
    assert any(position > 0 for positions, _ in reached for position in positions)


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_of_kept_drafts(cycling_model: Path, logprobs_mode: str) -> None:
    """A request asking for logprobs drafts too: each kept token's logprobs (its own and the top
    ones) are those decoding without drafts gives, at their positions."""
    params = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
              SamplingParams(temperature=0.5, top_k=20, max_tokens=80, ignore_eos=True, logprobs=0, seed=3),
              SamplingParams(temperature=0, max_tokens=70, ignore_eos=True, logprobs=2, stop_token_ids=[1])]
    plain = make_llm(cycling_model, logprobs_mode=logprobs_mode)
    spec = make_llm(cycling_model, logprobs_mode=logprobs_mode, speculative_config=NGRAM, disable_log_stats=False)
    expected, got = plain.generate(PROMPTS[:4], params, use_tqdm=False), spec.generate(PROMPTS[:4], params, use_tqdm=False)
    for index in (0, 1, 3):
        want, have = expected[index].outputs[0], got[index].outputs[0]
        assert list(have.token_ids) == list(want.token_ids)
        if want.logprobs is None:
            assert have.logprobs is None
            continue
        assert len(have.logprobs) == len(want.logprobs) == len(want.token_ids)
        for token, a, b in zip(want.token_ids, want.logprobs, have.logprobs):
            assert token in b and list(a) == list(b)
            assert [x.rank for x in b.values()] == [x.rank for x in a.values()]
            assert np.allclose([x.logprob for x in b.values()], [x.logprob for x in a.values()], atol=1e-4)
    sampled = got[2].outputs[0]
    assert [list(lp) for lp in sampled.logprobs] == [[token] for token in sampled.token_ids]
    assert _spec_metrics(spec)["vllm:spec_decode_num_accepted_tokens"].value > 100


def test_parallel_samples_and_beam_search_with_drafts(cycling_model: Path, greedy_reference: list[list[int]]) -> None:
    """n > 1 (each sample its own engine request, drafting on its own) and beam search (on top
    of the engine, one token a request) give what they give without drafts."""
    plain, spec = make_llm(cycling_model), make_llm(cycling_model, speculative_config=NGRAM)
    samples = spec.generate(PROMPTS[:2], SamplingParams(n=3, temperature=0, max_tokens=100, ignore_eos=True),
                            use_tqdm=False)
    assert [[list(c.token_ids) for c in output.outputs] for output in samples] == \
           [[tokens] * 3 for tokens in greedy_reference[:2]]
    seeded = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    first, again = (spec.generate(PROMPTS[:1], seeded, use_tqdm=False)[0] for _ in range(2))
    assert [list(c.token_ids) for c in first.outputs] == [list(c.token_ids) for c in again.outputs]
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    want, have = plain.beam_search(PROMPTS[:2], beams), spec.beam_search(PROMPTS[:2], beams)
    assert [[b.tokens for b in o.sequences] for o in have] == [[b.tokens for b in o.sequences] for o in want]


def test_streamed_deltas_over_a_spawned_engine_core(cycling_model: Path, greedy_reference: list[list[int]]) -> None:
    """AsyncLLM with the engine core in its own process: the steps that keep drafts reach the
    stream as their tokens, in order, nothing lost or repeated."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(cycling_model), dtype="float32", max_model_len=256,
                                                  speculative_config=NGRAM))
    loop = asyncio.new_event_loop()

    async def stream(i: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        tokens: list[int] = []
        async for output in engine.generate(PROMPTS[i], params, request_id=f"r{i}"):
            tokens.extend(output.outputs[0].token_ids)
        return tokens

    async def all_streams() -> list[list[int]]:
        return list(await asyncio.gather(*(stream(i) for i in range(len(PROMPTS)))))

    try:
        assert loop.run_until_complete(all_streams()) == greedy_reference
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


# ---- the wire: a step's extra tokens as steps of one ----
def test_split_token_columns_places_each_finish_with_its_last_token() -> None:
    outputs = EngineCoreOutputs(["a", "b", "c"], np.array([1, 2, 3], dtype=np.int32),
                                finished=[FinishedRequest("b", FinishReason.STOP), FinishedRequest("c", FinishReason.LENGTH),
                                          FinishedRequest("gone", FinishReason.ABORT)],
                                more_token_ids=np.array([[10, 11], [-1, -1], [30, -1]], dtype=np.int32),
                                num_draft_tokens=np.array([2, 3, 1], dtype=np.int32),
                                num_accepted_drafts=np.array([2, 0, 1], dtype=np.int32))
    steps = split_token_columns(outputs)
    assert [(s.req_ids, s.new_token_ids.tolist(), [f.request_id for f in s.finished]) for s in steps] == [
        (["a", "b", "c"], [1, 2, 3], ["b", "gone"]), (["a", "c"], [10, 30], ["c"]), (["a"], [11], [])]
    assert steps[0].num_accepted_drafts.tolist() == [2, 0, 1] and steps[1].num_draft_tokens is None
    plain = EngineCoreOutputs(["a"], np.array([1], dtype=np.int32))
    assert split_token_columns(plain) == [plain]


# ---- what is refused ----
@pytest.mark.parametrize("config, words", [
    ({"method": "mlp_speculator", "model": "some/speculator", "num_speculative_tokens": 3},
     "method='mlp_speculator' is not implemented"),
    ({"method": "mtp", "num_speculative_tokens": 3}, "method='mtp' is not implemented"),
    ({"method": "suffix", "num_speculative_tokens": 3}, "method='suffix' is not implemented"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 3},
     "prompt_lookup_min must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2.5},
     "prompt_lookup_max must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical_acceptance_sampler"},
     "'acceptance_method' not implemented"),
    ("ngram", "must be a dict"),
])
def test_refused_speculative_configs(tiny_llama: Path, config: object, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(model=str(tiny_llama), speculative_config=config).create_engine_config()


def test_refused_combinations(tiny_llama: Path, tiny_mistral_window: Path) -> None:
    with pytest.raises(ValueError, match="async_scheduling=True"):
        EngineArgs(model=str(tiny_llama), speculative_config=NGRAM, async_scheduling=True).create_engine_config()
    with pytest.raises(ValueError, match="every layer slides"):
        EngineArgs(model=str(tiny_mistral_window), speculative_config=NGRAM).create_engine_config()
    with pytest.raises(ValueError, match="logits_processors"):
        EngineArgs(model=str(tiny_llama), speculative_config=NGRAM,
                   logits_processors=["custom_logits_processors:ForcedToken"]).create_engine_config()


def test_prompt_lookup_defaults_as_vllm(tiny_llama: Path) -> None:
    def lookup(**given: int) -> tuple[int, int]:
        spec = EngineArgs(model=str(tiny_llama), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                      **given}).create_engine_config().speculative_config
        return spec.prompt_lookup_min, spec.prompt_lookup_max

    assert lookup() == (5, 5)
    assert lookup(prompt_lookup_max=3) == (3, 3)
    assert lookup(prompt_lookup_min=2) == (2, 2)
    assert lookup(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)
