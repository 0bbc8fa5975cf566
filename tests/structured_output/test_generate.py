"""Structured outputs end to end on a random-weight tiny model (in-process engine core): every
kind, greedy and random; mixed with unconstrained requests whose tokens must not change; a
preempted constrained request; invalid specs refused with the problem named."""

from __future__ import annotations

from pathlib import Path

import pytest

from structured_checks import KINDS
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.exceptions import RequestRejectedError
from vllm_lite.sampling_params import StructuredOutputsParams

NUM_PER_KIND = 50
MAX_TOKENS = 120


def constrained(kind: str, index: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    structured = KINDS[kind][0]
    if index % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)
    return SamplingParams(temperature=1.0, seed=index, max_tokens=max_tokens, structured_outputs=structured)


def assert_accepted(kind: str, text: str, finish_reason: str) -> None:
    _, check, bounded = KINDS[kind]
    if bounded or finish_reason == "stop":
        assert finish_reason == "stop", (kind, text)
        assert check(text), (kind, text)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    return make_llm(tiny_llama)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_greedy_and_random(llm, kind: str, prompts_token_ids: list[list[int]]) -> None:
    prompts = [{"prompt_token_ids": prompts_token_ids[i % len(prompts_token_ids)]} for i in range(8)]
    outputs = llm.generate(prompts, [constrained(kind, i) for i in range(8)], use_tqdm=False)
    for out in outputs:
        assert_accepted(kind, out.outputs[0].text, out.outputs[0].finish_reason)
    if kind == "json_object":  # unbounded: at least the greedy ones must close their object here
        assert any(out.outputs[0].finish_reason == "stop" for out in outputs)


def test_mixed_batch_keeps_unconstrained_tokens(llm, prompts_token_ids: list[list[int]]) -> None:
    """50 requests of every kind in one batch with unconstrained greedy and seeded random ones:
    the unconstrained tokens equal those of a run without the constrained requests."""
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)
            for i in range(12)]
    free_prompts = [{"prompt_token_ids": prompts_token_ids[i % len(prompts_token_ids)]} for i in range(12)]
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free, use_tqdm=False)]

    kinds = [kind for kind in KINDS for _ in range(NUM_PER_KIND)]
    params = [constrained(kind, i, max_tokens=60 if kind == "json_object" else MAX_TOKENS)
              for i, kind in enumerate(kinds)]
    prompts = [{"prompt_token_ids": prompts_token_ids[i % len(prompts_token_ids)]} for i in range(len(kinds))]
    # the unconstrained requests are spread through the batch
    order = list(range(len(kinds) + len(free)))
    mixed_prompts, mixed_params, slots = [], [], {}
    step = len(order) // len(free)
    free_positions = {step * j + 1: j for j in range(len(free))}
    constrained_iter = iter(range(len(kinds)))
    for position in order:
        if position in free_positions:
            j = free_positions[position]
            slots[position] = ("free", j)
            mixed_prompts.append(free_prompts[j])
            mixed_params.append(free[j])
        else:
            i = next(constrained_iter)
            slots[position] = ("constrained", i)
            mixed_prompts.append(prompts[i])
            mixed_params.append(params[i])
    outputs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    for position, out in enumerate(outputs):
        what, index = slots[position]
        if what == "free":
            assert out.outputs[0].token_ids == alone[index], index
        else:
            assert_accepted(kinds[index], out.outputs[0].text, out.outputs[0].finish_reason)


def test_preempted_constrained_requests_stay_valid(tiny_llama: Path, prompts_token_ids: list[list[int]]) -> None:
    # 13 usable blocks of 16 tokens: one request needs at most 12 (90 + 100 tokens)
    llm = make_llm(tiny_llama, num_kv_blocks=14, block_size=16)
    kinds = [kind for kind in KINDS if KINDS[kind][2] for _ in range(4)]
    params = [constrained(kind, i, max_tokens=100) for i, kind in enumerate(kinds)]
    prompts = [{"prompt_token_ids": prompts_token_ids[i % len(prompts_token_ids)]} for i in range(len(params))]
    # Grammars compiled first (they are cached by grammar): otherwise when each request may start
    # depends on how fast its grammar compiles, and with it whether the blocks ever run out.
    llm.generate(prompts[:1] * len(KINDS), [constrained(kind, 0, max_tokens=1) for kind in KINDS], use_tqdm=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    for kind, out in zip(kinds, outputs):
        assert_accepted(kind, out.outputs[0].text, out.outputs[0].finish_reason)


@pytest.mark.parametrize(("structured", "named"), [
    (dict(json="{not json"), "structured_outputs.json is invalid"),
    (dict(json={"type": "no-such-type"}), "structured_outputs.json is invalid"),
    (dict(regex="(a"), "structured_outputs.regex is invalid"),
    (dict(grammar="root ::= "), "structured_outputs.grammar is invalid"),
])
def test_invalid_spec_is_refused_with_its_problem(llm, structured: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(**structured)), use_tqdm=False)
    # the engine still serves
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(("structured", "named"), [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["b"]), "exactly one of"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(json_object=False), "structured_outputs.json_object"),
])
def test_structured_outputs_params_checks(structured: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        StructuredOutputsParams(**structured)


def test_unknown_structured_outputs_field_is_refused() -> None:
    with pytest.raises(ValueError, match="whitespace_patern"):
        SamplingParams(structured_outputs={"regex": "a", "whitespace_patern": " "})


@pytest.mark.parametrize(("structured", "accepted"), [({"json": {"type": "boolean"}}, {"true", "false"}),
                                                      ({"choice": ["yes", "no"]}, {"yes", "no"})])
def test_grammar_complete_before_min_tokens_stops(llm, structured: dict, accepted: set[str],
                                                  prompts_token_ids: list[list[int]]) -> None:
    """vLLM's rule: a grammar that allows nothing but EOS before min_tokens is reached wins over
    min_tokens (which would leave nothing to sample): the request ends with `stop`, its output
    the complete value, while an unconstrained request in the same batch still runs to min_tokens."""
    params = [SamplingParams(temperature=temperature, seed=3, max_tokens=40, min_tokens=20,
                             structured_outputs=StructuredOutputsParams(**structured))
              for temperature in (0.0, 1.0)]
    free = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20)
    prompts = [{"prompt_token_ids": prompts_token_ids[i]} for i in range(3)]
    *outs, free_out = llm.generate(prompts, [*params, free], use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert completion.text in accepted and len(completion.token_ids) < 20
    assert len(free_out.outputs[0].token_ids) >= 20


@pytest.mark.parametrize("structured", [dict(json={"$ref": "#"}), dict(regex=r"[^\s\S]"),
                                        dict(grammar="root ::= root")],
                         ids=["json-self-reference", "regex-no-character", "grammar-self-reference"])
def test_a_grammar_that_allows_no_token_fails_its_request_alone(llm, structured: dict,
                                                                prompts_token_ids: list[list[int]]) -> None:
    """Its language is empty: the first bitmask row is all zeros. Sampling it would emit a token
    outside the grammar; the request fails with the reason instead, the one beside it runs on."""
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts_token_ids[0]}
    alone = llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    dead = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**structured))
    try:
        engine.add_request("dead", prompt, dead)
    except ValueError as exc:  # xgrammar >= 0.2.9 finds the circular schema when it checks it
        assert "json" in structured and "structured_outputs.json is invalid" in str(exc)
        assert llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids == alone
        return
    engine.add_request("free", prompt, free)
    finished, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            finished.update({out.request_id: out for out in engine.step() if out.finished})
        except RequestRejectedError as exc:
            errors.append(exc)
    assert [exc.request_id for exc in errors] == ["dead"]
    assert "the grammar allows no next token" in str(errors[0])
    assert list(finished) == ["free"] and finished["free"].outputs[0].token_ids == alone
    assert llm.stats()["num_running"] == 0


def test_a_complete_value_may_end_with_any_of_the_requests_stop_tokens(llm, prompts_token_ids: list[list[int]]) -> None:
    """vLLM 0.32: the grammar's end allows the request's stop_token_ids as well as the model's end
    tokens (a request whose own end token is one of them ends the value with it). Here the stop
    token's logit is raised far above the rest: it ends the value (the request's stop_reason), it
    is refused while the value is incomplete, and without it in stop_token_ids EOS ends it."""
    eos = llm.get_tokenizer().eos_token_id
    stop_token = next(t for t in range(100, 200) if t != eos)
    structured = StructuredOutputsParams(regex="[a-c]{3}")
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_token], logit_bias={stop_token: 50.0},
                            structured_outputs=structured)
    without = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={stop_token: 50.0}, structured_outputs=structured)
    prompt = {"prompt_token_ids": prompts_token_ids[0]}
    with_stop, plain = (llm.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in (params, without))
    assert (with_stop.finish_reason, with_stop.stop_reason) == ("stop", stop_token)
    assert (plain.finish_reason, plain.stop_reason) == ("stop", None)
    assert with_stop.text == plain.text and len(with_stop.text) == 3 and set(with_stop.text) <= set("abc")
