"""Failure containment (issue 12): an exception that can be pinned on one request, wherever it
happens in a step (joining the worker's batch, its row's update, its sampling metadata, a
batched sampler op, its grammar bitmask row, taking its sampled token and checking its stop
conditions), fails and frees that request alone: its client gets an error naming the problem,
the scheduler frees its blocks, the worker drops it, and the requests stepped beside it (one
greedy, one seeded random) finish with the same tokens as without it. Faults are injected with
monkeypatch for the request id "poison" only. Every case runs with async scheduling on and off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.core.request import Request
from vllm_lite.exceptions import RequestRejectedError
from vllm_lite.sampling_params import StructuredOutputsParams

# 20 prompt tokens: a full block, which the prefix cache keeps (a failed request's blocks must
# not be served to the next request with its prompt: their KV may never have been written);
# + 24 outputs cross the next block boundary: every request gets a block mid-decode.
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True)  # for "c"
PROMPTS = {name: list(range(5 + 20 * i, 25 + 20 * i)) for i, name in enumerate(["a", "b", "c", "poison"])}
PROMPTS["d"] = PROMPTS["poison"]
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]+"))


def run(llm: LLM, request_ids: list[str], poison_params: SamplingParams = GREEDY
        ) -> tuple[dict[str, list[int]], list[RequestRejectedError]]:
    engine = llm.llm_engine
    for request_id in request_ids:
        prompt = PROMPTS[request_id.rstrip("0123456789")]
        params = poison_params if request_id == "poison" else SEEDED if request_id.startswith("c") else GREEDY
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    errors: list[RequestRejectedError] = []
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RequestRejectedError as exc:
            errors.append(exc)
            continue
        tokens.update({out.request_id: out.outputs[0].token_ids for out in outputs if out.finished})
    return tokens, errors


def _model_runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def fault_joining_the_batch(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = _model_runner(llm).input_batch
    add_request = batch.add_request

    def faulty(new):
        if new.req_id == "poison":
            raise RuntimeError("injected fault")
        return add_request(new)

    monkeypatch.setattr(batch, "add_request", faulty)


def fault_updating_its_row(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the running request gets its next block (not when it joins): the whole step's
    block-table update fails, then the poisoned request's own."""
    batch = _model_runner(llm).input_batch
    append_row, append_rows = batch.block_table.append_row, batch.block_table.append_rows

    def poisoned(row: int) -> bool:
        return batch.req_ids[row] == "poison" and batch.block_table.num_blocks[row] > 0

    def faulty(row, block_ids):
        if len(block_ids) and poisoned(row):
            raise RuntimeError("injected fault")
        return append_row(row, block_ids)

    def faulty_rows(rows, counts, block_ids):
        if any(poisoned(row) for row in rows.tolist()):
            raise RuntimeError("injected fault")
        return append_rows(rows, counts, block_ids)

    monkeypatch.setattr(batch.block_table, "append_row", faulty)
    monkeypatch.setattr(batch.block_table, "append_rows", faulty_rows)


def fault_building_its_sampling_metadata(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_lite.worker.model_runner as model_runner

    build = model_runner.build_sampling_metadata

    def faulty(batch, rows, *args, **kwargs):
        if "poison" in [batch.req_ids[row] for row in rows.tolist()]:
            raise RuntimeError("injected fault")
        return build(batch, rows, *args, **kwargs)

    monkeypatch.setattr(model_runner, "build_sampling_metadata", faulty)


def fault_checking_its_stop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    check_stop = Request.check_stop

    def faulty(self, token_id, max_model_len):
        if self.request_id == "poison" and self.num_output_tokens == 3:
            raise RuntimeError("injected fault")
        return check_stop(self, token_id, max_model_len)

    monkeypatch.setattr(Request, "check_stop", faulty)


def fault_filling_its_grammar_bitmask(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only "poison" is constrained here."""
    manager = llm.llm_engine.engine_core.structured_output_manager

    def faulty(requests):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(manager, "grammar_bitmask", faulty)


def fault_in_the_batched_sampler(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a batched op, where the rows are not told apart: only "poison" has a logit_bias
    here. The worker samples each row alone to find it."""
    import vllm_lite.sample.sampler as sampler

    def faulty(logits, bias):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(sampler, "apply_logit_bias", faulty)


CASES: dict[str, tuple[Callable[[LLM, pytest.MonkeyPatch], None], SamplingParams]] = {
    "joining the batch": (fault_joining_the_batch, GREEDY),
    "joining the batch, constrained": (fault_joining_the_batch, CONSTRAINED),
    "updating its row": (fault_updating_its_row, GREEDY),
    "building its sampling metadata": (fault_building_its_sampling_metadata, GREEDY),
    "building its sampling metadata, constrained": (fault_building_its_sampling_metadata, CONSTRAINED),
    # Stops are checked in Python only for rows that may stop: here its max_tokens.
    "checking its stop": (fault_checking_its_stop, GREEDY.clone_with(max_tokens=3)),
    "filling its grammar bitmask": (fault_filling_its_grammar_bitmask, CONSTRAINED),
    "in the batched sampler": (fault_in_the_batched_sampler, GREEDY.clone_with(logit_bias={7: 0.5})),
    "in the batched sampler, constrained": (fault_in_the_batched_sampler,
                                            CONSTRAINED.clone_with(logit_bias={7: 0.5})),
}


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(tiny_llama: Path, request: pytest.FixtureRequest):
    """With async scheduling, the step after the failing one is already in flight when the
    failure is known (the request has a placeholder there): it must be passed over."""
    llm = LLM(str(tiny_llama), multiprocess=False, max_model_len=256, num_kv_blocks=256, block_size=16, dtype="float32",
              async_scheduling=request.param)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(llm: LLM) -> dict[str, list[int]]:
    tokens, errors = run(llm, ["a", "b", "c"])
    assert not errors and len(tokens["a"]) == GREEDY.max_tokens
    return tokens


def assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == stats["num_waiting"] == 0
    assert "poison" not in _model_runner(llm).input_batch.req_id_to_index  # (the others leave it next step)


@pytest.mark.parametrize("case", list(CASES))
def test_a_request_failing_in_a_step_fails_alone(llm: LLM, reference: dict[str, list[int]], case: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    install, poison_params = CASES[case]
    install(llm, monkeypatch)
    tokens, errors = run(llm, ["a2", "poison", "c2"], poison_params)
    assert [(e.request_id, "injected fault" in str(e)) for e in errors] == [("poison", True)]
    assert tokens == {"a2": reference["a"], "c2": reference["c"]}
    assert_idle(llm)
    monkeypatch.undo()
    again, errors = run(llm, ["a3", "d3", "c3"])  # d3: the failed request's prompt
    assert not errors and again["a3"] == reference["a"] and again["c3"] == reference["c"]
    assert llm.llm_engine.engine_core.reset_prefix_cache()
    alone, _ = run(llm, ["d4"])
    assert again["d3"] == alone["d4"]


def test_an_out_of_vocabulary_token_the_boundary_missed_fails_its_request_alone(
        llm: LLM, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Defence in depth behind engine/request_checks.py (switched off here): a logit_bias token
    outside the vocabulary fails its request while its sampling metadata is built, not inside
    the batched logits op (an IndexError there could not be pinned on a row)."""
    import vllm_lite.engine.core as core
    import vllm_lite.engine.input_processor as input_processor

    monkeypatch.setattr(core, "check_request", lambda request, model_config: None)
    monkeypatch.setattr(input_processor, "check_sampling_params", lambda params, model_config: None)
    vocab_size = llm.llm_engine.engine_core.vllm_config.model_config.hf.vocab_size
    poison_params = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={vocab_size + 5: 1.0})
    tokens, errors = run(llm, ["a4", "poison", "c4"], poison_params)
    assert [e.request_id for e in errors] == ["poison"]
    assert "logit_bias" in str(errors[0]) and f"[0, {vocab_size})" in str(errors[0])
    assert tokens == {"a4": reference["a"], "c4": reference["c"]}
    assert_idle(llm)


@pytest.mark.parametrize("constraints", ["grammar after 3 tokens", "bad word at once"])
def test_a_request_whose_constraints_leave_nothing_to_sample_fails_alone(
        llm: LLM, reference: dict[str, list[int]], constraints: str) -> None:
    """allowed_token_ids with a grammar, or with a bad word, can exclude every token at a
    position (no check can know beforehand where a grammar leads): that request fails with an
    error naming its constraints, before a token outside them is drawn (its draws there are void:
    no -inf token in its output), and the requests stepped beside it go on unchanged."""
    token_a, token_b = llm.get_tokenizer().convert_tokens_to_ids(["a", "b"])
    assert token_a != token_b
    if constraints == "grammar after 3 tokens":  # "aaa" then the grammar needs "b", which is not allowed
        poison_params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[token_a],
                                       structured_outputs=StructuredOutputsParams(regex="a{3}b"))
    else:
        poison_params = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=[token_a], bad_words=["a"])
    from vllm_lite.entrypoints.openai.metrics import ServerMetrics
    from vllm_lite.metrics_reader import snapshot

    metrics = ServerMetrics("m")  # (the stat loggers of LLM(disable_log_stats=False))
    loggers = [metrics.record_iteration, metrics.record_requests]
    llm.llm_engine.stat_loggers += loggers
    try:
        tokens, errors = run(llm, ["a6", "poison", "c6"], poison_params)
    finally:
        del llm.llm_engine.stat_loggers[-len(loggers):]
    assert [e.request_id for e in errors] == ["poison"] and errors[0].while_running
    assert "allowed_token_ids, bad_words and structured-output grammar together exclude every token" in str(errors[0])
    assert tokens == {"a6": reference["a"], "c6": reference["c"]}
    finished = {m.labels["finished_reason"]: m.value for m in snapshot(metrics.registry)
                if m.name == "vllm:request_success" and m.value}
    assert finished == {"length": 2, "error": 1}  # (vLLM's finish reason "error" for a request a step failed on)
    assert_idle(llm)
