"""The client's output token ids: one int32 row per unfinished request (its slot), so that one
step's sampled tokens land with a single scatter instead of one append per request. (The
scheduler's core/token_store.TokenStore is another thing: prompt and output tokens of the
running requests with their stop limits, fixed at max_num_seqs x max_model_len.)

Invariant: row `slot` of `ids` holds the slot's output tokens in `[:counts[slot]]`; a slot is in
`free` iff no request holds it. `watched[slot]`: the client looks at each of the slot's tokens
(false for requests that need Python only at their first and last token, and, with
`intervals[slot]` = k > 0, at every k-th token after the first: streams with a stream interval).
`last_token_ts[slot]`: the engine-core step time of the slot's latest token (inter-token latency).
Rows and the row width grow by doubling (the width only as far as the longest output so far), so
memory follows what is in flight, never `max_model_len`.

A step's append and the client's look at its rows (`append_and_look`) run as one C loop over the
rows where csrc is built (vllm_lite._bookkeeping's `output_append`: numpy's dozen calls over
every row cost more than their work); `append` and `looked_at` are its numpy twin and fallback.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from vllm_lite.bookkeeping import chosen_loops

_INITIAL_ROWS = 64
_INITIAL_WIDTH = 64


class OutputTokenStore:
    def __init__(self, rows: int = _INITIAL_ROWS, width: int = _INITIAL_WIDTH, native: bool | None = None) -> None:
        """`native`: whether `append_and_look` runs csrc's loop (None: where it is built; True:
        it must be)."""
        self._native: ModuleType | None = chosen_loops(native)
        self._looked_at = np.zeros(rows, dtype=np.int64)  # `append_and_look`'s positions, from the C loop
        self.ids = np.zeros((rows, width), dtype=np.int32)
        self.counts = np.zeros(rows, dtype=np.int64)
        self.watched = np.zeros(rows, dtype=bool)
        self.intervals = np.zeros(rows, dtype=np.int64)
        self.last_token_ts = np.zeros(rows, dtype=np.float64)
        self.free: list[int] = list(range(rows - 1, -1, -1))

    def acquire(self, watched: bool = True, interval: int = 0) -> int:
        if not self.free:
            self._grow_rows()
        slot = self.free.pop()
        self.counts[slot] = 0
        self.watched[slot] = watched
        self.intervals[slot] = interval
        return slot

    def looked_at(self, slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Which of `slots` (just given their `counts`-th token) the client looks at this step:
        watched ones, first tokens, and every `intervals`-th token after the first."""
        intervals = self.intervals[slots]
        periodic = (intervals > 0) & ((counts - 1) % np.maximum(intervals, 1) == 0)
        return self.watched[slots] | (counts == 1) | periodic

    def append_and_look(self, slots: np.ndarray, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`append`, then `looked_at` as positions into `slots` (ascending): the slots' new
        counts and the positions the client looks at (from the C loop, a view valid until the
        next call)."""
        if self._native is None or not len(slots):
            counts = self.append(slots, token_ids)
            return counts, np.flatnonzero(self.looked_at(slots, counts))
        if len(self._looked_at) < len(slots):
            self._looked_at = np.zeros(max(len(slots), 2 * len(self._looked_at)), dtype=np.int64)
        counts = np.empty(len(slots), dtype=np.int64)
        num_looked_at, longest = self._native.output_append(
            np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(token_ids), self.ids, self.counts,
            self.watched, self.intervals, counts, self._looked_at)
        if longest >= self.ids.shape[1]:  # (the next append finds room in every row)
            self._grow_width(longest + 1)
        return counts, self._looked_at[:num_looked_at]

    def release(self, slot: int) -> np.ndarray:
        """Frees the slot; returns a copy of its tokens (its row will be reused)."""
        tokens = self.ids[slot, :self.counts[slot]].copy()
        self.free.append(slot)
        return tokens

    def append(self, slots: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """One token for each of `slots` (distinct), `token_ids[i]` to `slots[i]`; returns the
        slots' new token counts."""
        if not len(slots):
            return np.zeros(0, dtype=np.int64)
        positions = self.counts[slots]
        if int(positions.max()) + 1 >= self.ids.shape[1]:  # (every row keeps room for one more: the C loop's)
            self._grow_width(int(positions.max()) + 2)
        self.ids[slots, positions] = token_ids
        counts = positions + 1
        self.counts[slots] = counts
        return counts

    def _grow_rows(self) -> None:
        rows = len(self.counts)
        self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
        self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
        self.watched = np.concatenate([self.watched, np.zeros_like(self.watched)])
        self.intervals = np.concatenate([self.intervals, np.zeros_like(self.intervals)])
        self.last_token_ts = np.concatenate([self.last_token_ts, np.zeros_like(self.last_token_ts)])
        self.free.extend(range(2 * rows - 1, rows - 1, -1))

    def _grow_width(self, needed: int) -> None:
        rows, width = self.ids.shape
        grown = np.zeros((rows, max(needed, 2 * width)), dtype=np.int32)
        grown[:, :width] = self.ids
        self.ids = grown
