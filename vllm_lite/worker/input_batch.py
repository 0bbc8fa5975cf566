"""The persistent batch: one row per live request, kept in numpy buffers across steps.

Row-order invariant: rows `0 .. num_reqs-1` are live after `condense()`; removals leave holes
that `condense()` fills by moving the last live rows down. A new request takes the lowest hole,
so the rows depend only on which requests left and came, never on the order of removal (every
tensor-parallel rank must lay its batch out alike). Moves copy only a row's *active
prefix* (`token_ids[row, :num_tokens[row]]`, `block_ids[row, :num_blocks[row]]`) and its
scalars, never the whole `max_model_len` row; `num_elements_moved` counts what was copied.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import numpy as np

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.sample.seeded_draws import seed_key
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.block_table import BlockTable

Kept = TypeVar("Kept")


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        # +1: a prompt of max_model_len tokens still receives its one sampled token.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # token_ids[row, num_tokens[row] - 1]: a decode step's inputs read this array, not the table
        self.last_token_ids = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)  # 0 = off
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.has_seed = np.zeros(max_num_reqs, dtype=bool)
        self.seed_keys = np.zeros(max_num_reqs, dtype=np.uint64)  # sample/seeded_draws.py's seed_key
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1 = none asked
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # -1 = none asked
        self.has_logit_bias = np.zeros(max_num_reqs, dtype=bool)  # the bias itself: sampling_params
        self.has_allowed_token_ids = np.zeros(max_num_reqs, dtype=bool)  # the ids: sampling_params
        self.has_bad_words = np.zeros(max_num_reqs, dtype=bool)  # the sequences: sampling_params
        # logprob_token_ids: these rows' logprobs are of given ids (the ids: sampling_params)
        self.has_logprob_token_ids = np.zeros(max_num_reqs, dtype=bool)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int32)  # the row's LoRA adapter (lora_int_id; 0: none)
        # the prompt came as embeddings (vLLM's prompt_embeds): its token ids are placeholders
        self.prompt_is_embeds = np.zeros(max_num_reqs, dtype=bool)
        # The row's slot in the linear-attention states (gated_delta_rule.RecurrentStates): held
        # while its request is in the batch, whatever rows it moves through; the lowest free first.
        self.state_slots = np.zeros(max_num_reqs, dtype=np.int64)
        self._free_state_slots = list(range(max_num_reqs))
        # Which joining of a request a row holds (the batch's version when it joined): a step's
        # sampled tokens that reach the host after the batch changed are written only where the
        # request that sampled them still is (not a later one with the same id).
        self.row_serial = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.num_reqs = 0  # rows 0 .. num_reqs-1 are in use (holes possible until condense)
        # Live rows whose request asks for prompt logprobs: a step without any looks at no row
        # for them (the first numpy call after a forward pass costs tens of us: cold caches).
        self.num_prompt_logprob_rows = 0
        self._holes: list[int] = []
        self.version = 0  # bumped whenever the batch's composition or row order changes
        self._live: tuple[tuple[int, int], list[str]] = ((0, 0), [])  # see live_req_ids
        self.num_elements_moved = 0
        # Told each row move of `condense` (src, dst): the custom logits processors' BatchUpdate
        self.on_move: Callable[[int, int], None] | None = None

    # Per-row scalar arrays moved together with the row; subclasses/extensions append to this.
    def row_arrays(self) -> tuple[np.ndarray, ...]:
        return (self.num_tokens, self.last_token_ids, self.num_prompt_tokens, self.num_computed_tokens,
                self.temperature, self.top_p, self.top_k, self.min_p, self.has_seed, self.seed_keys,
                self.repetition_penalty, self.frequency_penalty,
                self.presence_penalty, self.min_tokens, self.num_logprobs, self.num_prompt_logprobs,
                self.has_logit_bias, self.has_allowed_token_ids, self.has_bad_words, self.has_logprob_token_ids,
                self.lora_ids, self.row_serial, self.prompt_is_embeds, self.state_slots)

    @property
    def live_req_ids(self) -> list[str]:
        """The live rows' request ids in row order: one list, kept until the batch changes (a
        step's output names its rows with it; no reader changes it)."""
        key = (self.version, self.num_reqs)  # (`condense` may end with fewer rows and no move)
        if self._live[0] != key:
            self._live = (key, self.req_ids[: self.num_reqs])  # type: ignore[assignment]
        return self._live[1]

    def row_index(self, rows: np.ndarray) -> slice | np.ndarray:
        """`rows` (distinct live rows, ascending) as an index into the per-row arrays: a slice,
        read without a gather, when they are every live row (a steady decode step)."""
        return slice(0, len(rows)) if len(rows) == self.num_reqs else rows

    def in_step(self, rows: np.ndarray, query_lens: np.ndarray,
                requests: Mapping[str, Kept]) -> Iterator[tuple[str, Kept, int, int, int]]:
        """(request id, what `requests` keeps for it, its index among the step's `rows` (batch
        rows, ascending), first and end position of its tokens this step) of each of `requests`
        the step holds (positions read before the step's computed counts advance)."""
        for req_id, kept in requests.items():
            row = self.req_id_to_index.get(req_id)
            k = int(np.searchsorted(rows, row)) if row is not None else len(rows)
            if k == len(rows) or rows[k] != row:
                continue  # not in this step
            start = int(self.num_computed_tokens[row])
            yield req_id, kept, k, start, start + int(query_lens[k])

    def add_request(self, new: NewRequestData) -> int:
        """All or nothing: a request whose row cannot be written (a value that does not fit its
        array) raises and leaves the batch as it was; the row's bookkeeping is committed last."""
        if len(self._holes) > 1:
            # The lowest hole, whatever order the rows were removed in: under TP every rank
            # must give a request the same row, and the removals come from sets whose order
            # differs between processes (string hashing is seeded per process).
            self._holes.sort(reverse=True)
        row = self._holes[-1] if self._holes else self.num_reqs
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.last_token_ids[row] = new.token_ids[n - 1] if n else 0
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self._set_sampling_params(row, new.sampling_params)
        self.lora_ids[row] = new.lora_request.lora_int_id if new.lora_request is not None else 0
        self.prompt_is_embeds[row] = new.prompt_embeds is not None
        self.block_table.add_row(row, new.block_ids)
        self.state_slots[row] = heapq.heappop(self._free_state_slots)
        if self._holes:
            self._holes.pop()
        else:
            self.num_reqs += 1
        self.req_ids[row] = new.req_id
        self.sampling_params[row] = new.sampling_params
        self.num_prompt_logprob_rows += new.sampling_params.prompt_logprobs is not None
        self.req_id_to_index[new.req_id] = row
        self.version += 1
        self.row_serial[row] = self.version  # (versions only grow: each joining its own)
        return row

    def _set_sampling_params(self, row: int, params: SamplingParams) -> None:
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.min_p[row] = params.min_p
        self.has_seed[row] = params.seed is not None
        self.seed_keys[row] = 0 if params.seed is None else seed_key(params.seed)
        self.repetition_penalty[row] = params.repetition_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.has_logit_bias[row] = bool(params.logit_bias)
        self.has_allowed_token_ids[row] = params.allowed_token_ids is not None
        self.has_bad_words[row] = params.bad_words_token_ids is not None
        self.has_logprob_token_ids[row] = params.logprob_token_ids is not None

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        heapq.heappush(self._free_state_slots, int(self.state_slots[row]))
        self.num_prompt_logprob_rows -= self.sampling_params[row].prompt_logprobs is not None
        self.sampling_params[row] = None
        self._holes.append(row)
        self.version += 1
        return row

    def condense(self) -> None:
        """Fill holes with the last live rows so rows 0 .. num_reqs-1 are all live."""
        holes = sorted(self._holes)
        self._holes.clear()
        live = self.num_reqs - len(holes)
        last = self.num_reqs - 1
        for hole in holes:
            if hole >= live:
                break
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self.num_reqs = live

    def swap_states(self, a: int, b: int) -> None:
        na, nb = int(self.num_tokens[a]), int(self.num_tokens[b])
        saved = self.token_ids[a, :na].copy()
        self.token_ids[a, :nb] = self.token_ids[b, :nb]
        self.token_ids[b, :na] = saved
        for array in self.row_arrays():
            array[a], array[b] = array[b], array[a]
        moved = self.block_table.swap_rows(a, b)
        self.num_elements_moved += 2 * na + nb + moved + 2 * len(self.row_arrays())
        self.req_ids[a], self.req_ids[b] = self.req_ids[b], self.req_ids[a]
        self.sampling_params[a], self.sampling_params[b] = self.sampling_params[b], self.sampling_params[a]
        self.req_id_to_index[self.req_ids[a]] = a
        self.req_id_to_index[self.req_ids[b]] = b
        self.version += 1

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for array in self.row_arrays():
            array[dst] = array[src]
        moved = self.block_table.move_row(src, dst)
        self.num_elements_moved += n + moved + len(self.row_arrays())
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        if self.on_move is not None:
            self.on_move(src, dst)
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self.req_id_to_index[req_id] = dst
        self.version += 1
