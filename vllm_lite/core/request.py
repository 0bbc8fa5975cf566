"""A request as the scheduler sees it: token ids in a growable numpy buffer, progress counters."""

from __future__ import annotations

import enum

import numpy as np

from vllm_lite.wire import EngineCoreRequest, FinishReason
from vllm_lite.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_GRAMMAR = 4  # waiting, but not schedulable until its grammar is compiled


class Request:
    """Invariant: `token_ids[:num_tokens]` holds the prompt followed by every output token;
    `num_computed_tokens <= num_tokens + num_output_placeholders` (placeholders: async
    scheduling's tokens in flight, 0 otherwise); the buffer grows by doubling, so appending is O(1)
    amortized and no Python int objects are kept per token."""

    __slots__ = (
        "request_id", "sampling_params", "status",
        "token_ids", "num_prompt_tokens", "num_tokens", "num_computed_tokens", "max_tokens",
        "min_tokens", "eos_token_ids", "stop_token_ids", "block_hashes", "num_cached_tokens",
        "cache_salt", "prefix_lookup", "structured_output_request", "queued_ts", "scheduled_ts",
        "num_output_placeholders",
    )

    def __init__(self, request_id: str, prompt_token_ids: np.ndarray, sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, cache_salt: str | None = None) -> None:
        num_prompt = len(prompt_token_ids)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self.token_ids = np.empty(num_prompt + min(max_tokens, 64), dtype=np.int32)
        self.token_ids[:num_prompt] = prompt_token_ids
        self.num_prompt_tokens = num_prompt
        self.num_tokens = num_prompt
        self.num_computed_tokens = 0
        self.max_tokens = max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.cache_salt = cache_salt  # mixed into the first prefix-cache block key
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1 until scheduled
        # (block pool cache version, hit blocks, hit tokens) of the last lookup while waiting
        self.prefix_lookup: tuple[int, list, int] | None = None
        # The grammar state of a structured-output request (structured_output.manager's
        # StructuredOutputRequest, set by the engine core); None for every other request.
        self.structured_output_request = None
        # Engine-core time.monotonic() when the scheduler queued it and first scheduled it (vLLM's
        # QUEUED / SCHEDULED events; 0.0 until then), for the queue / prefill time metrics.
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        # Async scheduling: tokens sampled by scheduled steps whose output has not arrived yet
        # (computed by the scheduler's count, not yet in `token_ids`); 0 otherwise.
        self.num_output_placeholders = 0

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_ids,
                   req.max_tokens, req.cache_salt)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> np.ndarray:
        return self.token_ids[: self.num_tokens]

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.num_tokens == len(self.token_ids):
            grown = np.empty(2 * len(self.token_ids), dtype=np.int32)
            grown[: self.num_tokens] = self.token_ids[: self.num_tokens]
            self.token_ids = grown
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1

    def check_stop(self, token_id: int, max_model_len: int) -> tuple[FinishReason, int | None] | None:
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
        return None
