"""A request as the scheduler sees it: token ids (in a growable numpy buffer of its own, or in
the scheduler's token store while it runs), progress counters."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from vllm_lite.core.thinking_budget import ThinkingBudgetState
from vllm_lite.wire import REPETITION_STOP_REASON, EngineCoreRequest, FinishReason, ImageInputs
from vllm_lite.sampling_params import SamplingParams

# Why a request stops: the reason and its stop_reason (a stop token id, REPETITION_STOP_REASON, None)
StopReason = tuple[FinishReason, int | str | None]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_GRAMMAR = 4  # waiting, but not schedulable until its grammar is compiled


class SlotCounter:
    """A request's counter that lives in its token store's array of the same name while it holds
    a slot there (the scheduler's array code reads and writes it for the whole batch), and in
    the request's own field otherwise."""

    __slots__ = ("own_field", "column")

    def __init__(self, own_field: str, column: str) -> None:
        self.own_field, self.column = own_field, column

    def __get__(self, request: Request | None, owner: type) -> Any:
        if request is None:
            return self
        if request.store is None:
            return getattr(request, self.own_field)
        return int(getattr(request.store, self.column)[request.slot])

    def __set__(self, request: Request, value: int) -> None:
        if request.store is None:
            setattr(request, self.own_field, value)
        else:
            getattr(request.store, self.column)[request.slot] = value


class Request:
    """Invariant: `token_ids[:num_tokens]` holds the prompt followed by every output token;
    `num_computed_tokens <= num_tokens_with_placeholders = num_tokens + num_output_placeholders`
    (placeholders: tokens sampled by steps whose output has not arrived); its own buffer grows by
    doubling, so appending is O(1) amortized and no Python int objects are kept per token."""

    __slots__ = (
        "request_id", "sampling_params", "status",
        "_token_ids", "num_prompt_tokens", "_num_tokens", "_num_computed_tokens", "max_tokens",
        "min_tokens", "eos_token_ids", "stop_token_ids", "block_hashes", "num_cached_tokens",
        "cache_salt", "prefix_lookup", "structured_output_request", "thinking", "queued_ts", "scheduled_ts",
        "num_preemptions", "_num_tokens_with_placeholders", "length_limit", "store", "slot", "priority",
        "arrival_time", "lora_request", "may_draft", "prompt_embeds", "images",
    )

    def __init__(self, request_id: str, prompt_token_ids: np.ndarray, sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, cache_salt: str | None = None,
                 priority: int = 0, arrival_time: float = 0.0) -> None:
        num_prompt = len(prompt_token_ids)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self._token_ids = np.empty(num_prompt + min(max_tokens, 64), dtype=np.int32)
        self._token_ids[:num_prompt] = prompt_token_ids
        self.num_prompt_tokens = num_prompt
        self._num_tokens = num_prompt  # while it holds no slot in a token store
        self._num_computed_tokens = 0  # while it holds no slot (then: the store's)
        self.max_tokens = max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.cache_salt = cache_salt  # mixed into the first prefix-cache block key
        # Under the priority policy requests are served by (priority, arrival_time): `queue_key`.
        self.priority = priority
        self.arrival_time = arrival_time
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1 until scheduled
        # (block pool cache version, hit blocks, hit tokens) of the last lookup while waiting
        self.prefix_lookup: tuple[int, list, int] | None = None
        # The grammar state of a structured-output request (structured_output.manager's
        # StructuredOutputRequest, set by the engine core); None for every other request.
        self.structured_output_request = None
        # vLLM's thinking_token_budget (core/thinking_budget.py's ThinkingBudgetState); None without one.
        self.thinking = None
        # Engine-core time.monotonic() when the scheduler queued it and first scheduled it (vLLM's
        # QUEUED / SCHEDULED events; 0.0 until then), for the queue / prefill time metrics.
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.num_preemptions = 0  # times this request was preempted (vllm:request_num_preemptions)
        self._num_tokens_with_placeholders = num_prompt  # while it holds no slot (then: the store's)
        # The length that stops it (the scheduler caps it with max_model_len).
        self.length_limit = num_prompt + max_tokens
        # The scheduler's token store and the slot (row) this request holds in it while it runs;
        # `token_ids` is then that row and its counters (`num_tokens`,
        # `num_computed_tokens`, `num_tokens_with_placeholders`) live there too.
        # (a core.token_store.TokenStore, not imported here: that module imports this one)
        self.store: Any = None
        self.slot = -1
        # The LoRA adapter it runs with (vllm_lite.lora.request.LoRARequest); None: the base model.
        # Its id keys its prefix-cache blocks apart and counts against max_loras per step.
        self.lora_request = None
        # Whether speculative decoding may give it drafts (the scheduler's `drafts_allowed`)
        self.may_draft = False
        # vLLM's prompt_embeds (float32 [num_prompt_tokens, width]): the prompt's inputs, its token
        # ids placeholders; their bytes go into its prefix-cache keys
        self.prompt_embeds: np.ndarray | None = None
        # its images (wire.ImageInputs): the workers encode them; their hashes go into its
        # prefix-cache keys
        self.images: ImageInputs | None = None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        request = cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                      req.max_tokens, req.cache_salt, req.priority, req.arrival_time)
        if req.thinking is not None:
            request.thinking = ThinkingBudgetState(req.thinking, req.prompt_token_ids)
        request.lora_request = req.lora_request
        request.prompt_embeds = req.prompt_embeds
        request.images = req.images
        return request

    def queue_key(self) -> tuple[int, float]:
        """The priority policy's order (vLLM's): lower priority first, then earlier arrival."""
        return self.priority, self.arrival_time

    @property
    def token_ids(self) -> np.ndarray:
        """Its tokens, the first `num_tokens` of them (its own buffer, or its row of the token
        store: a view, current until its next token arrives)."""
        if self.store is None:
            return self._token_ids
        return self.store.row(self.slot)

    @property
    def num_tokens(self) -> int:
        """Known tokens: the prompt and the outputs that arrived (placeholders not counted)."""
        if self.store is None:
            return self._num_tokens
        return int(self.store.num_tokens[self.slot])

    # Tokens whose KV is computed (or scheduled to be: it moves at schedule time).
    num_computed_tokens = SlotCounter("_num_computed_tokens", "num_computed_tokens")
    # Known tokens plus those sampled by scheduled steps whose output has not arrived yet
    # (placeholders: one while its step runs; two with async scheduling). The scheduler counts
    # them when it schedules a sampling step; the output turns them into known ones.
    num_tokens_with_placeholders = SlotCounter("_num_tokens_with_placeholders", "num_tokens_with_placeholders")

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> np.ndarray:
        return self.token_ids[: self.num_tokens]

    @property
    def num_output_placeholders(self) -> int:
        """Tokens sampled by scheduled steps whose output has not arrived yet."""
        return self.num_tokens_with_placeholders - self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.store is not None:
            self.store.append_one(self.slot, token_id)
            return
        num_tokens = self._num_tokens
        if num_tokens == len(self._token_ids):
            grown = np.empty(2 * len(self._token_ids), dtype=np.int32)
            grown[:num_tokens] = self._token_ids[:num_tokens]
            self._token_ids = grown
        self._token_ids[num_tokens] = token_id
        self._num_tokens = num_tokens + 1

    def hold_slot(self, store: Any, slot: int) -> None:
        """Its tokens now live in `store`'s slot `slot` (TokenStore.assign copied them)."""
        self.store, self.slot = store, slot

    def leave_slot(self, token_ids: np.ndarray, num_tokens: int, num_computed_tokens: int,
                   num_tokens_with_placeholders: int) -> None:
        """Its tokens and counters are back in fields of its own (TokenStore.release)."""
        self.store, self.slot, self._token_ids, self._num_tokens = None, -1, token_ids, num_tokens
        self._num_computed_tokens = num_computed_tokens
        self._num_tokens_with_placeholders = num_tokens_with_placeholders

    def check_stop(self, token_id: int, max_model_len: int) -> StopReason | None:
        """Why the request stops after `token_id` was appended, or None to go on.
        EOS and stop tokens count only once `min_tokens` outputs exist."""
        num_output = self.num_tokens - self.num_prompt_tokens
        if num_output >= self.min_tokens:
            if token_id in self.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in self.stop_token_ids:
                return FinishReason.STOP, token_id
        if num_output >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH, None
        repetition = self.sampling_params.repetition_detection
        if repetition is not None and num_output >= self.min_tokens and \
                repetition.repeats(self.token_ids[self.num_prompt_tokens:self.num_tokens]):
            return FinishReason.REPETITION, REPETITION_STOP_REASON
        return None
