"""Per-batch sampling state, rebuilt only when the batch's composition changes.

Every optional part is None when no row in the batch uses it, so the sampler can skip that
work entirely; an all-greedy batch without logprobs, penalties, bias or min_tokens carries
nothing but `all_greedy=True`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.sample.occurrences import TokenHistory, TokenOccurrences
from vllm_lite.sample.seeded_draws import SeededRows


@dataclass(slots=True)
class PenaltyMetadata:
    """Rows with a repetition, frequency or presence penalty (the others are not touched)."""

    logits_rows: torch.Tensor  # int64 [m] rows of the logits
    batch_rows: np.ndarray  # [m] the same rows in the persistent batch
    req_ids: list[str]  # [m] their requests: keys of the incrementally kept occurrences
    repetition: torch.Tensor  # float32 [m, 1]
    frequency: torch.Tensor  # float32 [m, 1]
    presence: torch.Tensor  # float32 [m, 1]
    history: TokenHistory
    occurrences: TokenOccurrences  # outlives the metadata: kept by the model runner
    all_rows: bool  # every logits row is penalized, in order: no gather/scatter needed
    # Speculative decoding: output tokens a row has beyond its history (the drafts before its
    # position) as (index among the m rows, token) pairs; None without any.
    preceding: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class LogitBiasMetadata:
    """logit_bias of all rows as (row, token, bias) triples."""

    rows: torch.Tensor  # int64 [nnz]
    token_ids: torch.Tensor  # int64 [nnz]
    values: torch.Tensor  # float32 [nnz]


@dataclass(slots=True)
class AllowedTokensMetadata:
    """Rows with allowed_token_ids: every other token of theirs is masked to -inf."""

    rows: torch.Tensor  # int64 [m] logits rows
    disallowed: torch.Tensor  # bool [m, vocab]


@dataclass(slots=True)
class BadWordsMetadata:
    """Rows with bad words (vLLM's rule): a word's last token is banned on a row whose output
    (never the prompt) ends with the rest of the word; a one-token word always. The outputs are
    read at sampling time from the history, so the metadata outlives a step."""

    logits_rows: list[int]
    batch_rows: list[int]
    # per row: prefix length -> the words of that length + 1, as (prefix, last token)
    words: list[dict[int, list[tuple[tuple[int, ...], int]]]]
    history: TokenHistory


@dataclass(slots=True)
class MinTokensMetadata:
    """Rows with min_tokens > 0 and, as (row, token) pairs, the EOS/stop ids to suppress."""

    batch_rows: np.ndarray  # [m]
    min_tokens: np.ndarray  # int32 [m]
    pair_index: np.ndarray  # [num_pairs] index into the m rows
    pair_logits_rows: np.ndarray  # int64 [num_pairs]
    pair_token_ids: np.ndarray  # int64 [num_pairs]
    history: TokenHistory
    # Speculative decoding: each row's outputs beyond its history (the drafts before its
    # position); None without drafts.
    output_offsets: np.ndarray | None = None  # [m]


@dataclass(slots=True)
class RequestedLogprobsMetadata:
    """Rows with `logprob_token_ids`: their logprob columns 1..n are these ids, not the top-k."""

    rows: torch.Tensor  # int64 [m] rows of the logprobs (the rows that asked for logprobs)
    token_ids: torch.Tensor  # int64 [m, max n]; a row shorter than max n repeats its last id


@dataclass(slots=True)
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # float32 [num_rows, 1] (1.0 on greedy rows); None when all are 1.0
    greedy_mask: torch.Tensor | None  # bool [num_rows]; None unless greedy and random rows mix
    seeded: SeededRows | None  # the random rows with a seed (their draws keyed by position); None: none
    top_p: torch.Tensor | None = None  # float32 [num_rows]; None when no random row uses it
    top_k: torch.Tensor | None = None  # int64 [num_rows], 0 = off; None when no random row uses it
    min_p: torch.Tensor | None = None  # float32 [num_rows]; None when no random row uses it
    # top_p and top_k on the host: the sampler chooses its work from these, never by reading the
    # device (a sync there would stall a GPU step thread that launches ahead)
    top_p_host: np.ndarray | None = None
    top_k_host: np.ndarray | None = None
    max_num_logprobs: int = -1  # top-k width: largest `logprobs` of the rows without given ids; -1 = no row asked
    logprobs_rows: np.ndarray | None = None  # logits rows that asked, when not all of them do
    requested_logprobs: RequestedLogprobsMetadata | None = None  # None: no row gave logprob_token_ids
    penalties: PenaltyMetadata | None = None
    logit_bias: LogitBiasMetadata | None = None
    min_tokens: MinTokensMetadata | None = None
    allowed_tokens: AllowedTokensMetadata | None = None
    bad_words: BadWordsMetadata | None = None

    @property
    def needs_logits_processing(self) -> bool:
        return (self.penalties is not None or self.logit_bias is not None or self.min_tokens is not None
                or self.allowed_tokens is not None or self.bad_words is not None)
