"""TokenStore: the tokens and stop limits of the scheduler's running requests, one row (slot)
each in preallocated numpy arrays, so that `Scheduler.update_from_output` appends a step's
sampled tokens and evaluates the stop conditions with array operations over the batch, and
Python touches only the requests whose state changed (finished, first token, a grammar).

| array | per slot |
|---|---|
| `token_ids[slot, :num_tokens[slot]]` | the request's prompt then output tokens, but for its last `num_tokens[slot] % TAIL`, which may be only in `tail` (`Request.token_ids` is the row while it holds the slot, brought up to date by `row`) |
| `tail[slot, :num_tokens[slot] % TAIL]` | its last tokens since a multiple of TAIL: `append` writes each token here and a full tail into the row |
| `num_tokens` | its known tokens (placeholders of async scheduling not counted) |
| `num_computed_tokens`, `num_tokens_with_placeholders` | its progress counters (`Request`'s, read and written there while it holds the slot): the scheduler's running part of a step is array code over them |
| `num_prompt_tokens` | its prompt length (a first output token is reported with cache and timing data) |
| `length_limit` | `min(num_prompt_tokens + max_tokens, max_model_len)`: reaching it stops the request |
| `min_stop_len` | `num_prompt_tokens + min_tokens`: an EOS or stop id counts from this length on |
| `each_step` | Python must see every token (a grammar to advance) |
| `look_at_len` | the length from which Python looks at the slot's next token: 0 with `each_step`, the first output token's, else `length_limit`; moved on past the first output token when Python has seen it |

The loops a steady step runs over every running request (`append`; the scheduler's
`scan_running` and `advance_running`) run in C when the csrc extension `vllm_lite._bookkeeping`
is built (the same rules, one pass over each request's entries: numpy's calls over
1,024-element arrays cost more than the work itself); the numpy code is the fallback and the
reference the tests hold the C loops to.

A request holds a slot from admission until it is preempted or freed, so at most
`max_num_seqs` slots are taken; a preempted request takes its tokens back into a buffer of its
own. The tails are why a step's append is cheap at 1,024 requests: the rows' next positions
are a row (max_model_len tokens) apart, a cold cache line each after a forward pass, where the
tails of consecutive slots are consecutive lines; a row takes TAIL tokens at once. The EOS and
stop ids of the slots are pooled (`stop_ids`): one `isin` over the step's tokens finds the rows
that may stop on one, and Python decides those exactly (`Request.check_stop`).
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import numpy as np

from vllm_lite.bookkeeping import chosen_loops
from vllm_lite.core.request import Request

TAIL = 16  # tokens per slot in `tail`: one 64-byte cache line of int32


class RunningScan(NamedTuple):
    """`TokenStore.scan_running`: of each request given, its known tokens (placeholders
    included) and its computed ones; `scheduled`: None when every request is scheduled (has a
    token to compute), else which are; over the scheduled ones, the tokens to compute in all and
    the fewest one of them has (1 when none is scheduled); the positions of the scheduled ones
    whose known tokens outgrow their blocks, the blocks each needs more, and those in all."""

    known: np.ndarray
    computed: np.ndarray
    scheduled: np.ndarray | None
    total: int
    min_new: int
    to_allocate: np.ndarray
    new_blocks: np.ndarray
    num_new_blocks: int


class TokenStore:
    def __init__(self, num_slots: int, max_model_len: int, native: bool | None = None) -> None:
        """`native`: whether the per-request loops run in C (None: when it is built; True: it
        must be)."""
        self._native: ModuleType | None = chosen_loops(native)
        self._looked_at = np.zeros(num_slots, dtype=np.int64)  # `append`'s result, in the C loop
        self.token_ids = np.zeros((num_slots, max_model_len), dtype=np.int32)
        self.tail = np.zeros((num_slots, TAIL), dtype=np.int32)
        self.num_tokens = np.zeros(num_slots, dtype=np.int64)
        self.num_computed_tokens = np.zeros(num_slots, dtype=np.int64)
        self.num_tokens_with_placeholders = np.zeros(num_slots, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(num_slots, dtype=np.int64)
        self.length_limit = np.zeros(num_slots, dtype=np.int64)
        self.min_stop_len = np.zeros(num_slots, dtype=np.int64)
        self.each_step = np.zeros(num_slots, dtype=bool)
        self.look_at_len = np.zeros(num_slots, dtype=np.int64)
        self.requests: list[Request | None] = [None] * num_slots
        self.slot_of: dict[str, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # lowest slot first
        # Bumped whenever a slot changes hands: a map from a step's rows to slots is then rebuilt.
        self.version = 0
        self._stop_id_refs: dict[int, int] = {}  # EOS / stop id -> slots that stop on it
        self._stop_ids: np.ndarray | None = np.zeros(0, dtype=np.int32)  # None: to rebuild

    @property
    def stop_ids(self) -> np.ndarray:
        if self._stop_ids is None:
            self._stop_ids = np.fromiter(self._stop_id_refs, dtype=np.int32, count=len(self._stop_id_refs))
        return self._stop_ids

    def assign(self, request: Request, length_limit: int, each_step: bool) -> None:
        """Give `request` a slot: its tokens move into the store."""
        slot = self._free_slots.pop()
        n = request.num_tokens
        self.token_ids[slot, :n] = request.token_ids[:n]
        in_tail = n % TAIL
        self.tail[slot, :in_tail] = request.token_ids[n - in_tail:n]
        self.num_tokens[slot] = n
        self.num_computed_tokens[slot] = request.num_computed_tokens
        self.num_tokens_with_placeholders[slot] = request.num_tokens_with_placeholders
        self.num_prompt_tokens[slot] = request.num_prompt_tokens
        self.length_limit[slot] = length_limit
        self.min_stop_len[slot] = request.num_prompt_tokens + request.min_tokens
        self.each_step[slot] = each_step
        first_output_len = request.num_prompt_tokens + 1 if n == request.num_prompt_tokens else length_limit
        self.look_at_len[slot] = 0 if each_step else min(first_output_len, length_limit)
        self.requests[slot] = request
        self.slot_of[request.request_id] = slot
        self.version += 1
        for token_id in request.eos_token_ids | request.stop_token_ids:
            refs = self._stop_id_refs.get(token_id, 0)
            self._stop_id_refs[token_id] = refs + 1
            if not refs:
                self._stop_ids = None
        request.hold_slot(self, slot)

    def release(self, request: Request) -> None:
        """Take `request`'s slot back; its tokens and counters go back into fields of its own."""
        slot = request.slot
        n = int(self.num_tokens[slot])
        request.leave_slot(self.row(slot)[:n].copy(), n, int(self.num_computed_tokens[slot]),
                           int(self.num_tokens_with_placeholders[slot]))
        self.requests[slot] = None
        del self.slot_of[request.request_id]
        self._free_slots.append(slot)
        self.version += 1
        for token_id in request.eos_token_ids | request.stop_token_ids:
            refs = self._stop_id_refs[token_id] - 1
            if refs:
                self._stop_id_refs[token_id] = refs
            else:
                del self._stop_id_refs[token_id]
                self._stop_ids = None

    def row(self, slot: int) -> np.ndarray:
        """`slot`'s row of tokens, its tail written in: every one of its `num_tokens` is there
        (a view, current until the slot's next token)."""
        n = int(self.num_tokens[slot])
        in_tail = n % TAIL
        if in_tail:
            self.token_ids[slot, n - in_tail:n] = self.tail[slot, :in_tail]
        return self.token_ids[slot]

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Append one token to each of `slots` (distinct). Returns the positions (into `slots`)
        that Python must look at: the length limit reached, an EOS / stop id past min_tokens,
        a first output token, or a grammar (one comparison with `look_at_len` for all but the
        stop ids). From the C loop, a view valid until the next call."""
        if self._native is not None:
            count = self._native.store_append(
                np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(tokens), self.token_ids,
                self.tail, self.num_tokens, self.look_at_len, self.min_stop_len, self.length_limit, self.each_step,
                self.stop_ids, self._looked_at)
            return self._looked_at[:count]
        num_tokens = self.num_tokens[slots]
        capacity = self.token_ids.shape[1]
        if len(num_tokens) and int(num_tokens.max()) >= capacity:  # (as the C loop: nothing written)
            fullest = int(np.argmax(num_tokens))
            raise IndexError(f"slot {int(slots[fullest])} holds {int(num_tokens[fullest])} tokens, room for {capacity}")
        self.tail[slots, num_tokens % TAIL] = tokens
        num_tokens += 1
        full = np.flatnonzero(num_tokens % TAIL == 0)
        if len(full):
            self.token_ids[slots[full, None], num_tokens[full, None] - TAIL + np.arange(TAIL)] = self.tail[slots[full]]
        self.num_tokens[slots] = num_tokens
        attention = num_tokens >= self.look_at_len[slots]
        stop_ids = self.stop_ids
        if len(stop_ids):
            attention |= np.isin(tokens, stop_ids) & (num_tokens >= self.min_stop_len[slots])
        looked_at = np.flatnonzero(attention)
        if len(looked_at):  # past a first output token, only the length limit (or a grammar) is left
            seen = slots[looked_at]
            self.look_at_len[seen] = np.where(self.each_step[seen], 0, self.length_limit[seen])
        return looked_at

    def scan_running(self, slots: np.ndarray, held: np.ndarray, block_size: int) -> RunningScan:
        """The scheduler's look at running requests (`slots`, distinct) before a step: a request
        is scheduled unless its known tokens reach its length limit (tokens in flight end it);
        `held[i]`: the blocks request i holds (`KVCacheManager.held_blocks`), of `block_size`
        tokens each. Nothing is written."""
        if self._native is not None:
            n = len(slots)
            known, computed = np.empty(n, np.int64), np.empty(n, np.int64)
            to_allocate, new_blocks = np.empty(n, np.int64), np.empty(n, np.int64)
            every_one, total, min_new, count, num_new_blocks = self._native.running_scan(
                np.ascontiguousarray(slots, dtype=np.int64), self.num_tokens_with_placeholders,
                self.num_computed_tokens, self.length_limit, np.ascontiguousarray(held, dtype=np.int64), block_size,
                known, computed, to_allocate, new_blocks)
            scheduled = None if every_one else known < self.length_limit[slots]
            return RunningScan(known, computed, scheduled, total, min_new, to_allocate[:count], new_blocks[:count],
                               num_new_blocks)
        known, computed = self.num_tokens_with_placeholders[slots], self.num_computed_tokens[slots]
        scheduled = known < self.length_limit[slots]
        every_one = bool(scheduled.all())  # (most steps: no request has all its tokens in flight)
        num_new = known - computed if every_one else (known - computed)[scheduled]
        min_new = int(num_new.min()) if len(num_new) else 1
        needed = -(-known // block_size) - held
        to_allocate = np.flatnonzero(needed > 0 if every_one else scheduled & (needed > 0))
        new_blocks = needed[to_allocate]
        return RunningScan(known, computed, None if every_one else scheduled, int(num_new.sum()), min_new,
                           to_allocate, new_blocks, int(new_blocks.sum()))

    def advance_running(self, slots: np.ndarray, known: np.ndarray) -> None:
        """After the scheduler gave each of `slots` all its `known` tokens: every token known gets
        computed, a placeholder follows (the running part of a step; `Scheduler._advanced`)."""
        if self._native is not None:
            self._native.running_advance(np.ascontiguousarray(slots, dtype=np.int64), known,
                                         self.num_computed_tokens, self.num_tokens_with_placeholders)
            return
        self.num_computed_tokens[slots] = known
        self.num_tokens_with_placeholders[slots] = known + 1

    def append_one(self, slot: int, token_id: int) -> None:
        """(Leaves `look_at_len` as it is: if this is the first output token, the next `append`
        shows the row to Python once more, which finds nothing to do.)"""
        n = int(self.num_tokens[slot])
        if n >= self.token_ids.shape[1]:
            raise IndexError(f"slot {slot} holds {n} tokens, room for {self.token_ids.shape[1]}")
        self.tail[slot, n % TAIL] = token_id
        self.num_tokens[slot] = n + 1
        if (n + 1) % TAIL == 0:
            self.token_ids[slot, n + 1 - TAIL:n + 1] = self.tail[slot]
