"""SamplingParams with vLLM's field names and meaning, validated on construction."""

from __future__ import annotations

import enum

import msgspec

MAX_LOGPROBS = 20


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries all text/tokens so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, dict=False):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(self.repetition_penalty > 0.0, "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
                 f"must be in [-2, 2], got {self.frequency_penalty}")
        _require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
                 f"must be in [-2, 2], got {self.presence_penalty}")
        _require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
                 f"must be >= 1, got {self.max_tokens}")
        _require(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= MAX_LOGPROBS, name,
                     f"must be in [0, {MAX_LOGPROBS}], got {value}")
        _require(not self.stop or all(isinstance(s, str) and s for s in self.stop), "stop",
                 "must be a list of non-empty strings")
        _require(self.seed is None or -(2**63) <= self.seed < 2**63, "seed",
                 f"must fit in 64 bits, got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone_with(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"SamplingParams.{field} {message}")
