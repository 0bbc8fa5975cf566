"""Client-side logprobs of one request: EngineCoreOutputs' logprob rows -> the user-facing
`{token_id: Logprob}` dicts (built only for requests that asked)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vllm_lite.outputs import Logprob

TokenDecoder = Callable[[int], str | None]


def entry(token_ids: list[int], logprobs: list[float], ranks: list[int],
          decode: TokenDecoder) -> dict[int, Logprob]:
    """The chosen token first, then the top-k (a chosen token that is also in the top-k keeps
    its top-k rank, as in vLLM)."""
    return {token_id: Logprob(logprob, rank, decode(token_id))
            for token_id, logprob, rank in zip(token_ids, logprobs, ranks)}


@dataclass(slots=True)
class LogprobsState:
    num_logprobs: int | None  # the request's `logprobs`
    num_prompt_logprobs: int | None  # the request's `prompt_logprobs`
    num_prompt_tokens: int
    decode: TokenDecoder
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Filled by prompt position (a recomputed chunk overwrites the same rows); row p is the
    # logprob of prompt token p + 1.
    _prompt_ids: np.ndarray | None = None
    _prompt_logprobs: np.ndarray | None = None
    _prompt_ranks: np.ndarray | None = None
    _prompt_filled: np.ndarray | None = None  # bool per row

    def add_sample_row(self, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> None:
        width = self.num_logprobs + 1
        values = logprobs[:width].tolist()
        self.logprobs.append(entry(token_ids[:width].tolist(), values, ranks[:width].tolist(), self.decode))
        self.cumulative_logprob += values[0]

    def add_prompt_rows(self, start: int, token_ids: np.ndarray, logprobs: np.ndarray,
                        ranks: np.ndarray) -> None:
        width = self.num_prompt_logprobs + 1
        if self._prompt_ids is None:
            num_rows = max(self.num_prompt_tokens - 1, 0)
            self._prompt_ids = np.zeros((num_rows, width), dtype=np.int32)
            self._prompt_logprobs = np.zeros((num_rows, width), dtype=np.float32)
            self._prompt_ranks = np.zeros((num_rows, width), dtype=np.int32)
            self._prompt_filled = np.zeros(num_rows, dtype=bool)
        end = start + len(token_ids)
        self._prompt_ids[start:end] = token_ids[:, :width]
        self._prompt_logprobs[start:end] = logprobs[:, :width]
        self._prompt_ranks[start:end] = ranks[:, :width]
        self._prompt_filled[start:end] = True

    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """One entry per prompt token; the first is None (it has no prefix), and so is any
        position not computed yet."""
        if self.num_prompt_logprobs is None:
            return None
        out: list[dict[int, Logprob] | None] = [None]
        if self._prompt_ids is None:
            return out
        for ids, values, ranks, filled in zip(self._prompt_ids.tolist(), self._prompt_logprobs.tolist(),
                                              self._prompt_ranks.tolist(), self._prompt_filled.tolist()):
            out.append(entry(ids, values, ranks, self.decode) if filled else None)
        return out
