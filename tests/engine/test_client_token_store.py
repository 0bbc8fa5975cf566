"""OutputTokenStore: one scatter per step lands each request's token in its own row; rows and width
grow as requests and outputs do; a released row's tokens are kept by copy. `append_and_look`'s C
loop (vllm_lite._bookkeeping's `output_append`, where csrc is built) against the numpy code."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_fakes import EITHER_LOOPS, NEEDS_NATIVE_LOOPS
from vllm_lite.engine.output_token_store import OutputTokenStore


def test_scatter_growth_and_release() -> None:
    store = OutputTokenStore(rows=2, width=2)
    slots = [store.acquire() for _ in range(5)]  # grows the rows twice
    assert sorted(slots) == list(range(5))
    rng = np.random.default_rng(0)
    expected: dict[int, list[int]] = {slot: [] for slot in slots}
    for step in range(9):  # grows the width past 2, 4 and 8
        active = np.array([s for s in slots if step < 3 or s % 2 == 0])
        tokens = rng.integers(0, 1000, len(active)).astype(np.int32)
        store.append(active, tokens)
        for slot, token in zip(active.tolist(), tokens.tolist()):
            expected[slot].append(token)
    for slot in slots:
        assert store.ids[slot, :store.counts[slot]].tolist() == expected[slot]
    kept = store.release(slots[0])
    reused = store.acquire()
    assert reused == slots[0] and store.counts[reused] == 0
    store.append(np.array([reused]), np.array([7], np.int32))
    assert kept.tolist() == expected[slots[0]] and store.ids[reused, :1].tolist() == [7]


@EITHER_LOOPS
def test_append_and_look_matches_append_then_looked_at(native: bool) -> None:
    """Random steps through `append_and_look` (C loop or numpy) and through `append` +
    `looked_at` on a twin store: the same rows, counts and positions looked at, while rows and
    width grow, slots come and go, and watched / interval streams mix."""
    rng = np.random.default_rng(3)
    ours, reference = OutputTokenStore(rows=2, width=2, native=native), OutputTokenStore(rows=2, width=2, native=False)
    live: list[int] = []
    for step in range(60):
        for _ in range(int(rng.integers(0, 3))):
            watched, interval = bool(rng.integers(2)), int(rng.choice([0, 0, 1, 3, 5]))
            slot = ours.acquire(watched, interval)
            assert reference.acquire(watched, interval) == slot
            live.append(slot)
        if live and rng.random() < 0.2:
            gone = live.pop(int(rng.integers(len(live))))
            assert ours.release(gone).tolist() == reference.release(gone).tolist()
        active = np.array(sorted(rng.choice(live, int(rng.integers(0, len(live) + 1)), replace=False)), np.int64)
        tokens = rng.integers(0, 50_000, len(active)).astype(rng.choice([np.int32, np.int64]))
        counts, looked_at = ours.append_and_look(active, tokens)
        expected_counts = reference.append(active, tokens)
        assert counts.tolist() == expected_counts.tolist()
        assert looked_at.tolist() == np.flatnonzero(reference.looked_at(active, expected_counts)).tolist()
        for slot in live:
            n = int(reference.counts[slot])
            assert ours.counts[slot] == n and ours.ids[slot, :n].tolist() == reference.ids[slot, :n].tolist()
    assert ours.ids.shape[1] > 16 and len(ours.counts) > 2  # (the width and the rows grew)


@NEEDS_NATIVE_LOOPS
def test_the_c_loop_refuses_bad_slots_before_writing() -> None:
    store = OutputTokenStore(rows=4, width=4, native=True)
    slots = np.array([store.acquire(), store.acquire()], np.int64)
    store.append_and_look(slots, np.array([1, 2], np.int32))
    before = store.ids.copy(), store.counts.copy()
    with pytest.raises(IndexError, match="slot 9 out of range"):
        store.append_and_look(np.array([0, 9], np.int64), np.array([5, 6], np.int32))
    with pytest.raises(ValueError, match="2 slots, 1 tokens"):
        store.append_and_look(slots, np.array([5], np.int32))
    with pytest.raises(TypeError, match="tokens"):
        store.append_and_look(slots, np.array([5.0, 6.0]))
    assert (store.ids == before[0]).all() and (store.counts == before[1]).all()
    with pytest.raises(IndexError, match="named twice"):  # (never a write past a row's end)
        store.append_and_look(np.array([0] * 6, np.int64), np.arange(6, dtype=np.int32))
