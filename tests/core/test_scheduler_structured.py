"""The scheduler's structured-output hooks with a stand-in grammar (no grammar engine): a
request waits for its grammar without holding up others, gets a bitmask row exactly on the
steps it samples, advances its matcher with each appended token, stops when the grammar ends,
and is finished (reported once) when its grammar fails to compile."""

from __future__ import annotations

import numpy as np

from test_scheduler import make_request, make_scheduler, step
from vllm_lite.core.request import RequestStatus
from vllm_lite.wire import FinishReason


class FakeMatcher:
    def __init__(self, length: int) -> None:
        self.accepted: list[int] = []
        self.length = length

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


class FakeGrammar:
    def __init__(self, length: int) -> None:
        self.ready = False
        self.error: str | None = None
        self.matcher = FakeMatcher(length)

    def is_ready(self) -> bool:
        return self.ready or self.error is not None


class FakeManager:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def grammar_bitmask(self, grammars: list[FakeGrammar]) -> np.ndarray:
        self.calls.append(len(grammars))
        return np.full((len(grammars), 2), len(grammars), dtype=np.int32)


def test_a_compiling_grammar_holds_up_only_its_request() -> None:
    manager = FakeManager()
    scheduler = make_scheduler()
    scheduler.structured_output_manager = manager
    constrained = make_request("c", 6, max_tokens=10)
    grammar = FakeGrammar(length=3)
    constrained.structured_output_request = grammar
    scheduler.add_request(constrained)
    scheduler.add_request(make_request("free", 6))
    assert constrained.status == RequestStatus.WAITING_FOR_GRAMMAR

    out, _ = step(scheduler)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["free"]
    assert out.grammar_bitmask is None and out.structured_output_req_ids == ()
    assert scheduler.waiting[0] is constrained  # kept its place
    stats = scheduler.get_stats()  # vllm:num_requests_waiting_by_reason's "deferred"
    assert stats["num_waiting"] == stats["num_waiting_deferred"] == 1

    grammar.ready = True
    out, _ = step(scheduler, token=5)  # its prefill samples: it has a bitmask row
    assert "c" in [r.req_id for r in out.scheduled_new_reqs]
    assert out.structured_output_req_ids == ("c",) and out.grammar_bitmask.shape == (1, 2)
    assert grammar.matcher.accepted == [5]
    _, outputs = step(scheduler, token=6)
    _, outputs = step(scheduler, token=7)  # the third token ends the grammar
    assert grammar.matcher.accepted == [5, 6, 7]
    finished = {f.request_id: f.finish_reason for f in outputs.finished}
    assert finished["c"] == FinishReason.STOP
    assert constrained.num_output_tokens == 3 < constrained.max_tokens
    assert "c" not in scheduler.structured_req_ids


def test_no_bitmask_row_while_a_prompt_is_mid_prefill() -> None:
    manager = FakeManager()
    scheduler = make_scheduler(max_tokens=4)  # 4 tokens per step: a 10-token prompt takes 3 steps
    scheduler.structured_output_manager = manager
    request = make_request("c", 10, max_tokens=5)
    grammar = FakeGrammar(length=100)
    grammar.ready = True
    request.structured_output_request = grammar
    scheduler.add_request(request)
    rows = [step(scheduler)[0].structured_output_req_ids for _ in range(4)]
    assert rows == [(), (), ("c",), ("c",)]
    assert len(grammar.matcher.accepted) == 2


def test_a_failed_grammar_finishes_its_request_once() -> None:
    scheduler = make_scheduler()
    scheduler.structured_output_manager = FakeManager()
    request = make_request("c", 6)
    grammar = FakeGrammar(length=3)
    grammar.error = "grammar compilation failed: boom"
    request.structured_output_request = grammar
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.is_empty and not scheduler.waiting and "c" not in scheduler.requests
    assert [(f.request_id, f.finish_reason) for f in scheduler.take_failed()] == [("c", FinishReason.ABORT)]
    assert scheduler.take_failed() == []
    assert scheduler.kv_cache_manager.get_num_free_blocks() == scheduler.kv_cache_manager.num_usable_blocks
