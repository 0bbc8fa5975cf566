"""Client-side logprobs of one request: EngineCoreOutputs' logprob rows -> the user-facing
`{token_id: Logprob}` dicts (built only for requests that asked)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_lite.outputs import Logprob

TokenDecoder = Callable[[int], str | None]
IdsDecoder = Callable[[list[int]], str]
INCOMPLETE = "\ufffd"  # what a token whose bytes end inside a UTF-8 character decodes to, alone
MAX_CONTEXT = 4  # tokens: enough for any UTF-8 character split over byte tokens


def entry(token_ids: list[int], logprobs: list[float], ranks: list[int], decode: TokenDecoder,
          context: Callable[[], Sequence[int]] = tuple, decode_ids: IdsDecoder | None = None) -> dict[int, Logprob]:
    """The chosen token first, then the top-k (a chosen token that is also in the top-k keeps
    its top-k rank, as in vLLM). A token whose text alone ends inside a UTF-8 character gets the
    text it adds after `context()` (the tokens before its position: `completed_text`)."""
    out = {}
    for token_id, logprob, rank in zip(token_ids, logprobs, ranks):
        text = decode(token_id)
        if text is not None and text.endswith(INCOMPLETE) and decode_ids is not None:
            text = completed_text(token_id, context(), decode, decode_ids)
        out[token_id] = Logprob(logprob, rank, text)
    return out


def completed_text(token_id: int, context: Sequence[int], decode: TokenDecoder, decode_ids: IdsDecoder) -> str:
    """vLLM 0.32's rule for a logprob token that ends inside a UTF-8 character: with the fewest
    tokens before it (at most MAX_CONTEXT) that make the character whole, the text it completes
    (the bytes of the tokens before it that were themselves incomplete, whose own text was ""
    for that reason, count as its); "" when none do (the character is not whole yet)."""
    for n in range(1, min(len(context), MAX_CONTEXT) + 1):
        before = list(context[-n:])
        whole = decode_ids([*before, token_id])
        if whole.endswith(INCOMPLETE):
            continue
        complete = n
        while complete > 0 and (decode(before[complete - 1]) or "").endswith(INCOMPLETE):
            complete -= 1
        prefix = decode_ids(before[:complete]) if complete else ""
        return whole[len(os.path.commonprefix([prefix, whole])):]
    return ""


@dataclass(slots=True)
class LogprobsState:
    num_logprobs: int | None  # the request's `logprobs`
    num_prompt_logprobs: int | None  # the request's `prompt_logprobs`
    num_prompt_tokens: int
    decode: TokenDecoder
    decode_ids: IdsDecoder | None = None  # None: no text
    prompt_token_ids: Sequence[int] = ()  # (the context of the first tokens' text)
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
        self.logprobs.append(entry(token_ids[:width].tolist(), values, ranks[:width].tolist(), self.decode,
                                   self._sampled_context, self.decode_ids))
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
        prompt = self.prompt_token_ids
        for position, (ids, values, ranks, filled) in enumerate(zip(
                self._prompt_ids.tolist(), self._prompt_logprobs.tolist(), self._prompt_ranks.tolist(),
                self._prompt_filled.tolist()), start=1):
            context = functools.partial(_slice, prompt, max(position - MAX_CONTEXT, 0), position)
            out.append(entry(ids, values, ranks, self.decode, context, self.decode_ids) if filled else None)
        return out

    def _sampled_context(self) -> list[int]:
        """The tokens before the next sampled one (the prompt's last ones first)."""
        sampled = [next(iter(position)) for position in self.logprobs[-MAX_CONTEXT:]]
        missing = MAX_CONTEXT - len(sampled)
        if missing:
            prompt = self.prompt_token_ids
            sampled = [*_slice(prompt, max(len(prompt) - missing, 0), len(prompt)), *sampled]
        return sampled


def _slice(tokens: Sequence[int], start: int, end: int) -> list[int]:
    return [int(token) for token in tokens[start:end]]
