"""What users get back: RequestOutput with one CompletionOutput per sample; an embedding model's
EmbeddingRequestOutput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_lite.lora.request import LoRARequest

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
    # vLLM's: which weights (their version label, `LLM.update_weight_version`) sampled which output
    # tokens; on the final output only
    weight_versions: list[WeightVersionSpan] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """vLLM's: output tokens `[start, end)` were sampled by the weights labelled `version`."""

    version: str
    start: int
    end: int


@dataclass(slots=True)
class RequestStateStats:
    """Per-request timings, as vLLM's RequestStateStats: `arrival_time` is wall-clock
    (time.time()); the `*_ts` timestamps are time.monotonic(), for intervals: `arrival_ts` the
    client's, the others the engine core's (queued, first scheduled, first and last token;
    one clock on one host)."""

    arrival_time: float = 0.0
    arrival_ts: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # seconds from arrival to the first output token
    num_generation_tokens: int = 0
    num_preemptions: int = 0  # from the engine core, when the request finishes
    engine_index: int = 0  # the data-parallel engine that runs it (the metrics' `engine` label)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestStateStats | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (vLLM's)


@dataclass(slots=True)
class EmbeddingOutput:
    """An embedding model's vector for one prompt (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None


@dataclass(slots=True)
class ClassificationOutput:
    """A classification model's class probabilities for one prompt (vLLM's ClassificationOutput;
    the logits themselves with use_activation=False or a regression model)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What `LLM.classify` returns per prompt (vLLM's ClassificationRequestOutput)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None


@dataclass(slots=True)
class PoolingOutput:
    """vLLM's: a pooled output as a tensor (`LLM.encode`; here the embedding, a float32 torch.Tensor)."""

    data: Any


@dataclass(slots=True)
class PoolingRequestOutput:
    """What `LLM.encode` returns per prompt (vLLM's PoolingRequestOutput)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    """A pair's score (vLLM's ScoringOutput): an embedding model's cosine similarity."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What `LLM.score` returns per pair (vLLM's ScoringRequestOutput): the two texts' token ids
    joined (with the tokenizer's pad token between, as vLLM's)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
