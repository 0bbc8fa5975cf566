"""What the scheduler decided for one step: frozen and shared (never deep-copied); nobody
downstream mutates it, and workers copy what they need into their own state.

Not deeply immutable: `NewRequestData.token_ids` is a view of the request's live token buffer
(no copy per step). It is valid while the step runs: the engine core appends to that buffer only
beyond the view's end (or into a grown copy), and a multi-process executor serializes it at
submission. With async scheduling the view is read while the engine core updates other requests
from the previous step; a request that joins the batch in a step has no token in flight then."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_lite.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the workers have not seen yet (or that returns after preemption, in which case
    `token_ids` holds its prompt and the outputs generated before it was preempted)."""

    req_id: str
    token_ids: np.ndarray
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # EOS ids that end this request (none with ignore_eos): with stop_token_ids, the tokens the
    # sampler suppresses until min_tokens outputs exist.
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Requests the workers already hold: only what changed (the diff) is sent. Entry i of
    every column belongs to `req_ids[i]`."""

    req_ids: list[str]
    # lists in the engine core; int32 views of the step message's arrays on a TP rank
    new_block_ids: list[list[int]] | list[np.ndarray]
    num_computed_tokens: list[int] | np.ndarray  # before this step
    # bool: whether new_block_ids[i] is not empty (in a decode step, a few requests): a worker
    # finds the rows whose block table grows without looking at every request's list.
    has_new_blocks: np.ndarray

    @staticmethod
    def empty() -> CachedRequestData:
        return CachedRequestData([], [], [], np.zeros(0, dtype=bool))


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]  # finished or aborted since the last step: drop their state
    preempted_req_ids: frozenset[str]  # preempted this step: drop their state, they come back new
    # Structured outputs: the constrained requests that sample this step and, row i for
    # structured_output_req_ids[i], their allowed next tokens (int32 [m, ceil(vocab / 32)],
    # bit t % 32 of word t // 32 = token t). None / empty when no sampling request is constrained.
    structured_output_req_ids: tuple[str, ...] = ()
    grammar_bitmask: np.ndarray | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
