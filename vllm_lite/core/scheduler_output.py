"""What the scheduler decided for one step: frozen and shared (never deep-copied); nobody
downstream mutates it, and workers copy what they need into their own state.

Not deeply immutable: `NewRequestData.token_ids` is a view of the request's live token buffer
(no copy per step). It is valid while the step runs: the engine core appends to that buffer only
beyond the view's end (or into a grown copy), and a multi-process executor serializes it at
submission. With async scheduling the view is read while the engine core updates other requests
from the previous step; a request that joins the batch in a step has no token in flight then."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_lite.lora.request import LoRARequest
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import ImageInputs


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
    lora_request: LoRARequest | None = None  # the adapter it runs with (the workers load it)
    # vLLM's prompt_embeds (float32 [num_prompt_tokens, width]): the prompt's inputs in place of its
    # token ids, which are placeholders then
    prompt_embeds: np.ndarray | None = None
    images: ImageInputs | None = None  # its images (the workers encode those not computed yet)


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Requests the workers already hold: only what changed (the diff) is sent. Entry i of
    every column belongs to `req_ids[i]`; its new blocks are the next `num_new_blocks[i]`
    entries of `new_block_ids`. Two arrays for the whole step, not a list per request: in a
    decode step most requests take no block, and in the step where many cross a block boundary
    together a list each would be a container per request."""

    req_ids: list[str]
    num_computed_tokens: list[int] | np.ndarray  # before this step
    num_new_blocks: np.ndarray  # int32 [len(req_ids)]
    new_block_ids: np.ndarray  # int32 [num_new_blocks.sum()], in request order

    def new_block_ids_of_each(self) -> list[np.ndarray]:
        """Request i's new block ids, for every i (views; one shared empty one for the many
        without any): for code that goes request by request."""
        per_request = [self.new_block_ids[:0]] * len(self.req_ids)
        growing = np.flatnonzero(self.num_new_blocks)
        ends = np.cumsum(self.num_new_blocks[growing]).tolist()
        for i, start, end in zip(growing.tolist(), [0, *ends], ends):
            per_request[i] = self.new_block_ids[start:end]
        return per_request

    @staticmethod
    def empty() -> CachedRequestData:
        return CachedRequestData([], [], np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32))


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
    # A request in it has a thinking budget (whose next forced token depends on this step's
    # tokens): under async scheduling the engine core takes this step's output before scheduling.
    needs_output_first: bool = False
    # Speculative decoding: request id -> its draft tokens (int32), computed this step after its
    # token (vLLM's name). Their count is in num_scheduled_tokens; num_computed_tokens moved past
    # them and comes back by the drafts the model did not keep.
    scheduled_spec_decode_tokens: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
