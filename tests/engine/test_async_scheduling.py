"""Async scheduling end to end (in-process engine core, tiny fp32 models): the engine core really
schedules step N+1 before it takes step N's output, and every output equals that of the same
engine with async scheduling off: greedy, seeded random with penalties and min_tokens, under
preemption, with stop ids and max_tokens finishing requests, with aborts and reused ids while a
token is in flight, and with structured outputs.

Every test runs twice: with the step thread finishing a step before launching the next (a CPU's
default) and launching the next first (a GPU's: step N+1 reads step N's sampled tokens from the
device tensor they were sampled into, before the host has them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llm_factory import make_llm
from structured_checks import KINDS
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.engine.core import EngineCore
from vllm_lite.exceptions import RequestRejectedError
from vllm_lite.executor.uniproc import UniProcExecutor
from vllm_lite.wire import EngineCoreRequest

MAX_TOKENS = 24


@pytest.fixture(autouse=True, params=[False, True], ids=["finish-first", "launch-ahead"])
def launch_ahead(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(UniProcExecutor, "launches_ahead", staticmethod(lambda device: request.param))
    return request.param


def generate(model: Path, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             async_scheduling: bool, **engine_args: Any) -> tuple[list[tuple[list[int], str, Any]], dict]:
    llm = make_llm(model, async_scheduling=async_scheduling, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outputs], stats


def on_and_off(model: Path, prompts: list[list[int]], params, **engine_args: Any):
    on, on_stats = generate(model, prompts, params, True, **engine_args)
    off, off_stats = generate(model, prompts, params, False, **engine_args)
    return on, off, on_stats, off_stats


def test_the_next_step_is_submitted_before_the_last_output_is_taken(tiny_llama: Path,
                                                                      prompts_token_ids: list[list[int]]) -> None:
    core = make_core(tiny_llama, async_scheduling=True)
    calls: list[str] = []
    executor = core.executor
    submit, take = executor.submit_model, executor.take_model_output
    executor.submit_model = lambda sched: (calls.append("submit"), submit(sched))[1]
    executor.take_model_output = lambda: (calls.append("take"), take())[1]
    try:
        core.add_request(core_request("a", prompts_token_ids[0], max_tokens=3))
        first = core.step()
        assert first.req_ids == [] and core.in_flight is not None  # step 1 runs, nothing out yet
        outputs = [first]
        while core.has_unfinished_requests():
            outputs.append(core.step())
    finally:
        core.shutdown()
    assert calls[:3] == ["submit", "submit", "take"]
    assert calls.count("submit") == calls.count("take") == 3  # no step past max_tokens
    assert sum(len(o.req_ids) for o in outputs) == 3


def test_greedy_outputs_equal_async_off(tiny_models: dict[str, Path], prompts_token_ids: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("tiny_llama", "tiny_qwen3"):
        on, off, _, _ = on_and_off(tiny_models[name], prompts_token_ids, params, max_num_batched_tokens=16)
        assert on == off, name


def test_sampling_under_preemption_equals_async_off(tiny_llama_tied: Path, prompts_token_ids: list[list[int]]) -> None:
    """Seeded random sampling (the generators' draws stay in order), penalties and min_tokens
    (kept by the worker, which has the token in flight) and logprobs, with requests preempted
    while a token of theirs is in flight."""
    prompts = prompts_token_ids * 2
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2) if i % 3 == 0 else
              SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=40, min_tokens=5,
                             repetition_penalty=1.3, presence_penalty=0.5) for i in range(len(prompts))]
    on, off, on_stats, off_stats = on_and_off(tiny_llama_tied, prompts, params, num_kv_blocks=18, block_size=16)
    assert on_stats["num_preemptions"] > 0 and off_stats["num_preemptions"] > 0
    assert on == off
    assert on_stats["kv_blocks_free"] == on_stats["kv_blocks_total"]


def test_stop_ids_and_max_tokens_finish_as_with_async_off(tiny_llama: Path,
                                                          prompts_token_ids: list[list[int]]) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference, _ = generate(tiny_llama, prompts_token_ids, free, False)
    params = []
    for i, (tokens, _, _) in enumerate(reference):
        if i % 2 == 0:  # stops on its 6th token (or earlier, when that token came before)
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[tokens[5]],
                                         ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True))
    on, off, _, _ = on_and_off(tiny_llama, prompts_token_ids, params)
    assert on == off
    for i, (tokens, reason, stop) in enumerate(on):
        if i % 2 == 0:
            assert reason == "stop" and stop == reference[i][0][5] and len(tokens) <= 6
        else:
            assert reason == "length" and tokens == reference[i][0][:1 + i]


def test_aborts_and_reused_ids_while_a_token_is_in_flight(tiny_llama: Path,
                                                          prompts_token_ids: list[list[int]]) -> None:
    """Abort one request mid-generation and add a new one under its id right away: the new one's
    tokens equal its own run, the others' equal a run without the abort, and the aborted one
    got a prefix of its tokens."""
    free, _ = generate(tiny_llama, prompts_token_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                     ignore_eos=True), False)
    reused_prompt = prompts_token_ids[0][:7]
    (alone, _, _), = generate(tiny_llama, [reused_prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                          ignore_eos=True), False)[0]
    for async_scheduling in (True, False):
        core = make_core(tiny_llama, async_scheduling=async_scheduling)
        try:
            for i, prompt in enumerate(prompts_token_ids):
                core.add_request(core_request(f"r{i}", prompt, max_tokens=MAX_TOKENS))
            tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts_token_ids))}
            reused: list[int] = []
            num_steps = 0
            while core.has_unfinished_requests():
                outputs = core.step()
                num_steps += 1
                for req_id, token in zip(outputs.req_ids, outputs.new_token_ids.tolist()):
                    (reused if req_id == "r1" and num_steps > 5 else tokens[req_id]).append(token)
                if num_steps == 5:
                    core.abort_requests(["r1"])
                    core.add_request(core_request("r1", reused_prompt, max_tokens=MAX_TOKENS))
        finally:
            core.shutdown()
        for i in range(len(prompts_token_ids)):
            if i != 1:
                assert tokens[f"r{i}"] == free[i][0], (async_scheduling, i)
        assert 0 < len(tokens["r1"]) < MAX_TOKENS and tokens["r1"] == free[1][0][:len(tokens["r1"])]
        assert reused == alone, async_scheduling


def test_structured_outputs_equal_async_off(tiny_llama: Path, prompts_token_ids: list[list[int]]) -> None:
    """Constrained requests of every kind mixed with free ones: the grammar sees every token
    before the next bitmask is made, so the outputs equal those of a synchronous engine."""
    kinds = list(KINDS)
    params = []
    for i in range(2 * len(kinds) + 4):
        if i < 2 * len(kinds):
            structured = KINDS[kinds[i // 2]][0]
            params.append(SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=60,
                                         structured_outputs=structured))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    prompts = [prompts_token_ids[i % len(prompts_token_ids)] for i in range(len(params))]
    on, off, _, _ = on_and_off(tiny_llama, prompts, params)
    assert on == off


# ---- helpers ----

def make_core(model: Path, **engine_args: Any) -> EngineCore:
    args = EngineArgs(model=str(model), max_model_len=256, dtype="float32", **engine_args)
    return EngineCore(args.create_engine_config())


def core_request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, np.array(prompt, dtype=np.int32), params, (), time.time(), max_tokens)


def test_a_request_failing_alone_while_its_next_step_is_in_flight(tiny_llama: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The only request fails to join the worker's batch: its next step was scheduled before the
    failure was known; that step runs nothing, the request fails alone, later ones run."""
    llm = make_llm(tiny_llama, async_scheduling=True)
    try:
        batch = llm.llm_engine.engine_core.executor.worker.model_runner.input_batch
        add_request = batch.add_request

        def faulty_add_request(new):
            if new.req_id == "poison":
                raise RuntimeError("injected fault")
            return add_request(new)

        monkeypatch.setattr(batch, "add_request", faulty_add_request)
        engine = llm.llm_engine
        engine.add_request("poison", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8))
        errors = []
        while engine.has_unfinished_requests():
            try:
                engine.step()
            except RequestRejectedError as exc:
                errors.append(exc.request_id)
        assert errors == ["poison"]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        llm.shutdown()


def test_launch_ahead_order(tiny_llama: Path, prompts_token_ids: list[list[int]], launch_ahead: bool) -> None:
    """Launching ahead, the worker launches step N+1 before it finishes step N, except where
    step N+1 needs step N's tokens on the host (a penalized request: its occurrence counts read
    them there); finishing first, every launch is followed by its finish."""
    core = make_core(tiny_llama, async_scheduling=True)
    worker = core.executor.worker
    calls: list[str] = []
    launch, finish = worker.launch, worker.finish
    worker.launch = lambda sched: (calls.append("launch"), launch(sched))[1]
    worker.finish = lambda step: (calls.append("finish"), finish(step))[1]
    try:
        core.add_request(core_request("a", prompts_token_ids[0], max_tokens=4))
        while core.has_unfinished_requests():
            core.step()
        free_calls, calls[:] = list(calls), []
        penalized = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, repetition_penalty=1.5)
        core.add_request(EngineCoreRequest("b", np.array(prompts_token_ids[1], dtype=np.int32), penalized, (),
                                           time.time(), 4))
        while core.has_unfinished_requests():
            core.step()
    finally:
        core.shutdown()
    if launch_ahead:
        assert free_calls == ["launch", "launch", "finish", "launch", "finish", "launch", "finish", "finish"]
    else:
        assert free_calls == ["launch", "finish"] * 4
    assert calls == ["launch", "finish"] * 4


def test_the_batch_holds_every_known_token(tiny_llama: Path, prompts_token_ids: list[list[int]],
                                           launch_ahead: bool) -> None:
    """After every step the worker's batch holds, in the row of each of its requests, every token
    the scheduler knows of it (and its last token where none is in flight), while requests
    finish at different steps (rows move), are preempted and resumed, and a running request is
    aborted and its id reused at once (the new one joins the batch in the step that drops the old
    one, whose last token is still in flight): the tokens a step finished after the batch
    changed went to the rows of the requests that sampled them."""
    if not launch_ahead:
        pytest.skip("finishing first, the step thread may still be running a step when step() returns")
    core = make_core(tiny_llama, async_scheduling=True, num_kv_blocks=14, block_size=16)
    batch = core.executor.worker.model_runner.input_batch
    prompts = prompts_token_ids * 2
    reused = False
    try:
        for i, prompt in enumerate(prompts):
            core.add_request(core_request(f"r{i}", prompt, max_tokens=8 + 3 * i))
        num_steps = 0
        while core.has_unfinished_requests():
            core.step()
            num_steps += 1
            for row, req_id in enumerate(batch.live_req_ids):
                request = core.scheduler.requests.get(req_id)
                if request is None:
                    continue  # finished; its row leaves with the next step
                known = request.all_token_ids
                assert batch.token_ids[row, :len(known)].tolist() == known.tolist(), (num_steps, req_id)
                if batch.num_tokens[row] == len(known):
                    assert batch.last_token_ids[row] == known[-1], (num_steps, req_id)
            last = f"r{len(prompts) - 1}"
            if not reused and not core.scheduler.waiting and last in batch.req_id_to_index:
                # Longer than the old one's tokens: its in-flight token would land on a prompt token.
                core.abort_requests([last])
                core.add_request(core_request(last, prompts_token_ids[6] + prompts_token_ids[7], max_tokens=20))
                reused = True
        assert reused and core.scheduler.get_stats()["num_preemptions"] > 0
    finally:
        core.shutdown()
