"""What users get back: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class LogprobsArrays:
    """Logprobs of a group of positions, column-wise (what workers hand to the engine core).

    Column 0 is the sampled (or, for prompt logprobs, the actual next prompt) token; columns
    1..k are the k most likely tokens, most likely first, so their ranks are 1..k."""

    token_ids: np.ndarray  # int32 [num_positions, k + 1]
    logprobs: np.ndarray  # float32 [num_positions, k + 1]
    ranks: np.ndarray  # int32 [num_positions, k + 1]

    def slice_rows(self, start: int, stop: int) -> LogprobsArrays:
        return LogprobsArrays(self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop])
