"""What one engine step's outputs tell the metrics (vLLM's IterationStats and
FinishedRequestStats), built by the OutputProcessor only when a stat logger listens (the server's
/metrics, an AsyncLLM's or LLM's stats line and `LLM.get_metrics()` when the stats are on):
numbers and arrays per step, nothing per token.

Timings use the engine core's clock (EngineCoreOutputs.timestamp and the scheduling times), as
vLLM's do:

| metric | interval |
|---|---|
| queue time | queued -> first scheduled |
| prefill time | first scheduled -> first token |
| decode time | first token -> last token |
| inference time | first scheduled -> last token |
| time per output token | decode time / (generated tokens - 1) |
| inter-token latency | a request's token's step -> its previous token's step |
| iteration tokens | prompt tokens of the requests whose first token came this step + tokens generated |
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_lite.outputs import RequestStateStats


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished engine request (each of n samples is one). `e2e_latency` and
    `first_token_latency` are the client's (arrival -> now / -> its first token); `n`: the
    request's n, given with the last of its samples to finish (vLLM observes it once per request)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    num_preemptions: int = 0
    e2e_latency: float = 0.0
    first_token_latency: float = 0.0
    max_tokens: int | None = None
    n: int | None = None
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache
    max_num_generation_tokens: int = 0  # given with n: the most tokens one of the request's n generated

    @property
    def mean_time_per_output_token(self) -> float:
        return self.decode_time / (self.num_generation_tokens - 1) if self.num_generation_tokens > 1 else 0.0

    @classmethod
    def of(cls, stats: RequestStateStats, finish_reason: str, num_prompt_tokens: int, num_generation_tokens: int,
           max_tokens: int | None = None, n: int | None = None, num_cached_tokens: int = 0,
           max_num_generation_tokens: int = 0) -> FinishedRequestStats:
        return cls(finish_reason, num_prompt_tokens, num_generation_tokens,
                   queued_time=max(stats.scheduled_ts - stats.queued_ts, 0.0),
                   prefill_time=max(stats.first_token_ts - stats.scheduled_ts, 0.0),
                   decode_time=max(stats.last_token_ts - stats.first_token_ts, 0.0),
                   inference_time=max(stats.last_token_ts - stats.scheduled_ts, 0.0),
                   num_preemptions=stats.num_preemptions,
                   e2e_latency=max(time.monotonic() - stats.arrival_ts, 0.0),
                   first_token_latency=stats.first_token_latency, max_tokens=max_tokens, n=n,
                   num_cached_tokens=num_cached_tokens, max_num_generation_tokens=max_num_generation_tokens)


@dataclass(slots=True)
class SpecDecodingStats:
    """A step's speculative decoding (vLLM's SpecDecodingStats): the requests that had drafts,
    their draft tokens, the drafts the model kept, and the kept ones at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.add_per_position(other.num_accepted_tokens_per_pos)

    def add_per_position(self, accepted: list[int]) -> None:
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(accepted) - len(per_pos)))
        for position, count in enumerate(accepted):
            per_pos[position] += count


@dataclass(slots=True)
class IterationStats:
    engine_index: int = 0  # the data-parallel engine whose step it is
    num_prompt_tokens: int = 0  # computed: the prefix cache's hits excluded
    num_generation_tokens: int = 0
    # seconds, one array per batch of rows the step was processed in
    inter_token_latencies: list[np.ndarray] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    spec_decoding: SpecDecodingStats | None = None  # set in a step with drafts

    def count_drafts(self, num_draft_tokens: np.ndarray, num_accepted: np.ndarray) -> None:
        """A step's rows' draft counts and kept drafts (0 drafts: a row without any)."""
        drafted = num_draft_tokens > 0
        if not drafted.any():
            return
        accepted = num_accepted[drafted]
        spec = self.spec_decoding = self.spec_decoding or SpecDecodingStats()
        spec.num_drafts += int(drafted.sum())
        spec.num_draft_tokens += int(num_draft_tokens.sum())
        spec.num_accepted_tokens += int(accepted.sum())
        # (kept at a position: kept more drafts than the position's index)
        spec.add_per_position([int((accepted > position).sum()) for position in range(int(num_draft_tokens.max()))])

    @property
    def num_tokens(self) -> int:
        """vllm:iteration_tokens_total's observation (vLLM's: computed prompt tokens + generated)."""
        return self.num_prompt_tokens + self.num_generation_tokens


StatLogger = Callable[[IterationStats], None]


def kv_cache_usage(stats: dict[str, Any]) -> float:
    """vllm:kv_cache_usage_perc from the engine's get_stats(): the fraction of blocks in use."""
    total = stats.get("kv_blocks_total", 0)
    free = stats.get("kv_blocks_free", total)
    return (total - free) / total if total else 0.0
