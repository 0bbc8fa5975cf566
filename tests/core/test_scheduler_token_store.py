"""The scheduler's token store: running requests' tokens in one array, stop conditions as array
operations over the batch, and Python only for the rows that need it. `append` runs as numpy
code and, where csrc is built, as the C loop of vllm_lite._bookkeeping: every test of it runs
both, and the two must leave the same store and name the same rows on random steps."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest

from vllm_lite.config import CacheConfig, SchedulerConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.bookkeeping import native_loops
from vllm_lite.core.token_store import TAIL, TokenStore
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import FinishReason
from scheduler_fakes import EITHER_LOOPS, NEEDS_NATIVE_LOOPS, distinct_prompt

EOS = 7


def test_the_c_loop_is_built_where_a_compiler_is() -> None:
    compiler = (sysconfig.get_config_var("CXX") or "c++").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip("no C++ compiler: the numpy path is the one there is")
    assert native_loops is not None, "a C++ compiler is present but vllm_lite._bookkeeping is not built"


def make_request(request_id: str, num_prompt: int, max_tokens: int, **params) -> Request:
    return Request(request_id, distinct_prompt(request_id, num_prompt), SamplingParams(**params), (EOS,), max_tokens)


@EITHER_LOOPS
def test_a_request_s_tokens_move_into_its_slot_and_back(native: bool) -> None:
    store = TokenStore(num_slots=2, max_model_len=32, native=native)
    request = make_request("a", 5, max_tokens=8, stop_token_ids=[9])
    prompt = request.all_token_ids.copy()
    store.assign(request, length_limit=13, each_step=False)
    assert request.slot == 0 and np.shares_memory(request.token_ids, store.token_ids)
    assert sorted(store.stop_ids.tolist()) == [EOS, 9]
    request.append_token(3)
    store.append(np.array([0]), np.array([4], dtype=np.int32))
    assert request.num_tokens == 7 and request.all_token_ids.tolist() == prompt.tolist() + [3, 4]
    store.release(request)
    assert request.store is None and not np.shares_memory(request.token_ids, store.token_ids)
    assert request.all_token_ids.tolist() == prompt.tolist() + [3, 4] and len(store.stop_ids) == 0
    request.append_token(5)  # its own buffer grows
    assert request.all_token_ids.tolist()[-3:] == [3, 4, 5]


@EITHER_LOOPS
def test_a_request_reads_every_token_across_tails(native: bool) -> None:
    """Appends write each slot's tail and a full tail into the row (TAIL tokens at once):
    whatever the point, a request's tokens (`token_ids`, `all_token_ids`), its slot's row and
    what it takes back on leaving are exactly its history; one that comes back with a partial
    tail goes on from there. Two slots at different offsets, tokens one at a time and in steps."""
    width = 4 * TAIL
    store = TokenStore(num_slots=2, max_model_len=width, native=native)
    requests = [make_request("a", 3, max_tokens=width), make_request("b", TAIL + 7, max_tokens=width)]
    history = [request.all_token_ids.tolist() for request in requests]
    for request in requests:
        store.assign(request, length_limit=width, each_step=False)
    rng = np.random.default_rng(3)
    for step in range(2 * TAIL + 3):
        tokens = rng.integers(100, 200, 2).astype(np.int32)
        if step % 5 == 4:  # (a request's own append, as async scheduling's late tokens take)
            requests[0].append_token(int(tokens[0]))
            store.append(np.array([1]), tokens[1:])
        else:
            store.append(np.array([0, 1]), tokens)
        for i, request in enumerate(requests):
            history[i].append(int(tokens[i]))
            assert request.all_token_ids.tolist() == history[i], (step, i)
            assert store.row(request.slot)[:len(history[i])].tolist() == history[i], (step, i)
        if step == TAIL:  # "b" leaves mid-tail and comes back into a slot
            store.release(requests[1])
            assert requests[1].all_token_ids.tolist() == history[1]
            store.assign(requests[1], length_limit=width, each_step=False)
    assert [len(h) for h in history] == [2 * TAIL + 6, 3 * TAIL + 10]  # (both past two tails)
    for request, tokens in zip(requests, history):
        store.release(request)
        assert request.all_token_ids.tolist() == tokens


@EITHER_LOOPS
def test_a_full_row_is_refused_and_nothing_written(native: bool) -> None:
    store = TokenStore(num_slots=3, max_model_len=4, native=native)
    store.num_tokens[:] = [1, 4, 2]  # slot 1's row is full
    before = store.token_ids.copy(), store.tail.copy(), store.num_tokens.copy()
    with pytest.raises(IndexError, match="slot 1 holds 4 tokens, room for 4"):
        store.append(np.array([0, 1]), np.array([5, 6], dtype=np.int32))
    with pytest.raises(IndexError, match="slot 1 holds 4 tokens, room for 4"):
        store.append_one(1, 5)
    assert all(np.array_equal(now, then) for now, then in zip((store.token_ids, store.tail, store.num_tokens), before))


@EITHER_LOOPS
def test_append_points_at_the_rows_python_must_see(native: bool) -> None:
    store = TokenStore(num_slots=5, max_model_len=64, native=native)
    requests = [make_request("first", 4, 10), make_request("long", 4, 2), make_request("eos", 4, 10),
                make_request("early", 4, 10, min_tokens=5), make_request("plain", 4, 10)]
    for request in requests:
        store.assign(request, length_limit=request.length_limit, each_step=False)
    store.append(np.arange(1, 5), np.array([1, 1, 1, 1], dtype=np.int32))  # everyone's first token but "first"'s
    slots = np.arange(5)
    attention = store.append(slots, np.array([1, 1, EOS, EOS, 2], dtype=np.int32))
    # "first": its first token; "long": max_tokens; "eos": EOS. Not "early" (EOS before min_tokens), not "plain".
    assert attention.tolist() == [0, 1, 2]


@EITHER_LOOPS
def test_append_points_at_the_rows_the_stop_rules_name_on_random_steps(native: bool) -> None:
    """Step after step, `append` names exactly the rows that the rules name when evaluated from
    scratch: a first output token, the length limit, a grammar (every token), an EOS / stop id
    from min_tokens on. Slots change hands on the way (a request leaves; one resumed with
    outputs takes its slot)."""
    rng = np.random.default_rng(0)
    store = TokenStore(num_slots=6, max_model_len=64, native=native)
    requests = [make_request(f"r{i}", int(rng.integers(2, 6)), int(rng.integers(3, 20)),
                             min_tokens=int(rng.integers(0, 4)), stop_token_ids=[9] if i % 2 else None)
                for i in range(6)]
    for i, request in enumerate(requests):
        store.assign(request, request.length_limit, each_step=i == 4)
    for step in range(30):
        if not store.slot_of:
            break
        if step == 2:  # a request leaves with its outputs and comes back into a slot
            resumed = store.requests[min(store.slot_of.values())]
            store.release(resumed)
            store.assign(resumed, resumed.length_limit, each_step=False)
        slots = np.array(sorted(store.slot_of.values()))
        live = [store.requests[slot] for slot in slots.tolist()]
        tokens = rng.choice(np.array([1, 2, EOS, 9], dtype=np.int32), len(slots))
        before = [request.num_tokens for request in live]
        # (one stop-id set for all slots: a row whose token stops another may stop; Python decides)
        pooled_stop_ids = set().union(*(request.eos_token_ids | request.stop_token_ids for request in live))
        want = [i for i, (request, token, n) in enumerate(zip(live, tokens.tolist(), before))
                if n + 1 == request.num_prompt_tokens + 1 or n + 1 >= request.length_limit
                or store.each_step[request.slot]
                or (token in pooled_stop_ids and n + 1 >= request.num_prompt_tokens + request.min_tokens)]
        assert store.append(slots, tokens).tolist() == want, step
        for request in live:
            if request.num_tokens >= request.length_limit:  # it finishes: its slot is free again
                store.release(request)


@NEEDS_NATIVE_LOOPS
def test_the_c_loop_leaves_the_store_as_the_numpy_code_does() -> None:
    """Random stores and steps (int32 and int64 tokens, stop ids or none, every kind of row):
    both paths name the same rows and leave every array alike."""
    rng = np.random.default_rng(1)
    for trial in range(300):
        num_slots, width = int(rng.integers(1, 12)), 48
        stores = [TokenStore(num_slots, width, native=native) for native in (False, True)]
        state = {"num_tokens": rng.integers(1, 30, num_slots), "look_at_len": rng.integers(0, 40, num_slots),
                 "min_stop_len": rng.integers(0, 40, num_slots), "length_limit": rng.integers(30, width, num_slots),
                 "each_step": rng.integers(0, 2, num_slots).astype(bool)}
        stop_ids = rng.choice(np.arange(8, dtype=np.int32), int(rng.integers(0, 3)), replace=False)
        for store in stores:
            for name, values in state.items():
                getattr(store, name)[:] = values
            store._stop_ids = stop_ids
        for step in range(3):
            slots = rng.permutation(num_slots)[:int(rng.integers(0, num_slots + 1))].astype(np.int64)
            tokens = rng.integers(0, 8, len(slots)).astype(np.int32 if trial % 2 else np.int64)
            named = [store.append(slots, tokens).tolist() for store in stores]
            assert named[0] == named[1], (trial, step)
            for name in ("token_ids", "tail", "num_tokens", "look_at_len"):
                assert np.array_equal(getattr(stores[0], name), getattr(stores[1], name)), (trial, step, name)


@NEEDS_NATIVE_LOOPS
def test_the_running_scan_and_advance_in_c_equal_the_numpy_code() -> None:
    """The scheduler's look at its running requests and their counters' advance: random
    counters, length limits, held blocks and block sizes (requests with all their tokens in
    flight, some outgrowing their blocks), any subset of slots in any order."""
    rng = np.random.default_rng(2)
    for trial in range(300):
        num_slots = int(rng.integers(1, 12))
        stores = [TokenStore(num_slots, 64, native=native) for native in (False, True)]
        computed = rng.integers(0, 30, num_slots)
        state = {"num_computed_tokens": computed, "num_tokens_with_placeholders": computed + rng.integers(0, 4, num_slots),
                 "length_limit": rng.integers(1, 40, num_slots)}
        for store in stores:
            for name, values in state.items():
                getattr(store, name)[:] = values
        slots = rng.permutation(num_slots)[:int(rng.integers(0, num_slots + 1))].astype(np.int64)
        held, block_size = rng.integers(0, 10, len(slots)), int(rng.choice([1, 4, 16]))
        scans = [store.scan_running(slots, held, block_size) for store in stores]
        for field in ("known", "computed", "to_allocate", "new_blocks"):
            assert np.array_equal(getattr(scans[0], field), getattr(scans[1], field)), (trial, field)
        assert (scans[0].scheduled is None) == (scans[1].scheduled is None), trial
        if scans[0].scheduled is not None:
            assert np.array_equal(scans[0].scheduled, scans[1].scheduled), trial
        assert (scans[0].total, scans[0].min_new, scans[0].num_new_blocks) == (
            scans[1].total, scans[1].min_new, scans[1].num_new_blocks), trial
        # (the rule itself: a scheduled request outgrowing its blocks takes what its tokens need)
        want = [(i, -(-k // block_size) - h) for i, (k, h) in enumerate(zip(scans[0].known.tolist(), held.tolist()))
                if -(-k // block_size) > h and (scans[0].scheduled is None or scans[0].scheduled[i])]
        assert list(zip(scans[0].to_allocate.tolist(), scans[0].new_blocks.tolist())) == want, trial
        for store, scan in zip(stores, scans):
            store.advance_running(slots, scan.known)
        for name in state:
            assert np.array_equal(getattr(stores[0], name), getattr(stores[1], name)), (trial, name)


@NEEDS_NATIVE_LOOPS
def test_the_c_loop_refuses_a_slot_or_row_out_of_range_and_writes_nothing() -> None:
    store = TokenStore(num_slots=3, max_model_len=4, native=True)  # (a full row: the test above, both paths)
    store.num_tokens[:] = [1, 3, 2]
    before = store.token_ids.copy(), store.num_tokens.copy(), store.tail.copy()
    with pytest.raises(IndexError, match="slot 3 out of range"):
        store.append(np.array([0, 3]), np.array([5, 6], dtype=np.int32))
    with pytest.raises(ValueError, match="2 slots, 1 tokens"):
        store.append(np.array([0, 2]), np.array([5], dtype=np.int32))
    assert all(np.array_equal(now, then) for now, then in zip((store.token_ids, store.num_tokens, store.tail), before))
    with pytest.raises(IndexError, match="running_scan: slot 3 out of range"):
        store.scan_running(np.array([3]), np.array([9]), 4)
    with pytest.raises(ValueError, match="running_scan: block_size must be positive, got 0"):
        store.scan_running(np.array([0]), np.array([9]), 0)
    with pytest.raises(IndexError, match="running_advance: slot -1 out of range"):
        store.advance_running(np.array([0, -1]), np.array([2, 2]))
    assert store.num_computed_tokens.tolist() == [0, 0, 0]
    store.num_tokens[:] = [1, 3, 2]  # a slot named twice (callers name each once) stops at its row's end
    with pytest.raises(IndexError, match="slot 1 named twice"):
        store.append(np.array([1, 1]), np.array([5, 6], dtype=np.int32))
    assert store.row(1).tolist() == [0, 0, 0, 5] and store.row(2).tolist() == [0, 0, 0, 0]


def test_python_looks_only_at_rows_that_change(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = Scheduler(SchedulerConfig(8, 64, 256, True), CacheConfig(4, 64, None, True), 64)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 5, max_tokens=4 if i == 1 else 10))
    checked: list[str] = []
    check_stop = Request.check_stop

    def counting(self, token_id, max_model_len):
        checked.append(self.request_id)
        return check_stop(self, token_id, max_model_len)

    monkeypatch.setattr(Request, "check_stop", counting)

    def step(tokens: dict[str, int]):
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = np.array([[tokens.get(r, 1)] for r in ids], dtype=np.int32)
        return scheduler.update_from_output(out, ids, sampled, np.ones(len(ids), dtype=np.int32))

    step({})
    assert sorted(checked) == [f"r{i}" for i in range(6)]  # first tokens
    checked.clear()
    outputs = step({"r2": EOS})
    assert checked == ["r2"] and [(f.request_id, f.finish_reason) for f in outputs.finished] == [("r2", FinishReason.STOP)]
    assert len(outputs.req_ids) == 6 and "r2" not in scheduler.requests
    checked.clear()
    step({})
    step({})
    assert checked == ["r1"] and "r1" not in scheduler.requests  # its max_tokens (4) reached
    assert [r.request_id for r in scheduler.running] == ["r0", "r3", "r4", "r5"]
    assert scheduler.requests["r0"].all_token_ids[5:].tolist() == [1, 1, 1, 1]
