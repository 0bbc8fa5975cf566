"""OutputTokenStore: one scatter per step lands each request's token in its own row; rows and width
grow as requests and outputs do; a released row's tokens are kept by copy."""

from __future__ import annotations

import numpy as np

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
