"""Failure containment (issue 12): an exception a worker can pin on one request (here injected
while that request joins the persistent batch) fails and frees that request alone: its client
gets an error, the scheduler frees its blocks, the worker drops it, and the requests stepped
beside it finish with the same greedy tokens as without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_lite import LLM, SamplingParams
from vllm_lite.exceptions import RequestRejectedError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def run(llm: LLM, request_ids: list[str]) -> tuple[dict[str, list[int]], list[RequestRejectedError]]:
    engine = llm.llm_engine
    for request_id, prompt in zip(request_ids, PROMPTS + PROMPTS):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY)
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


def test_a_request_failing_in_the_worker_fails_alone(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_llama), multiprocess=False, max_model_len=256, num_kv_blocks=256)
    try:
        reference, _ = run(llm, ["a", "b", "c"])
        batch = llm.llm_engine.engine_core.executor.worker.model_runner.input_batch
        add_request = batch.add_request

        def faulty_add_request(new):  # the fault, for one request id only
            if new.req_id == "poison":
                raise RuntimeError("injected fault")
            return add_request(new)

        monkeypatch.setattr(batch, "add_request", faulty_add_request)
        tokens, errors = run(llm, ["a2", "poison", "c2"])
        assert [(e.request_id, "injected fault" in str(e)) for e in errors] == [("poison", True)]
        assert tokens == {"a2": reference["a"], "c2": reference["c"]}
        assert "poison" not in batch.req_id_to_index
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0
        monkeypatch.undo()
        again, errors = run(llm, ["a3", "b3", "c3"])
        assert not errors and again == {"a3": reference["a"], "b3": reference["b"], "c3": reference["c"]}
    finally:
        llm.shutdown()
