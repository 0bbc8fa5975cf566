"""Token sampling. An all-greedy batch is one argmax over the logits, with no copy.

Order (vLLM's): grammar bitmask (structured outputs, constrained rows only) -> raw logprobs
(if asked) -> allowed_token_ids, bad words, min_tokens, logit_bias, custom logits processors
that can change an argmax, penalties -> greedy argmax -> temperature -> min-p -> the other custom
processors -> top-k/top-p -> random draw (one uniform per row: ops/topk_topp.py);
with a "processed" logprobs_mode the logprobs are taken just before the draw instead. Rows that
allowed_token_ids and bad words left no token are named in the output (`emptied_rows`): their
requests fail rather than keep a token drawn from nothing.

The sampler owns `logits`: float32 logits are edited in place, half-precision ones are copied
to float32 once, and only when something has to edit them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.config import LOGPROBS_MODES
from vllm_lite.host_to_device import host_to_device
from vllm_lite.sample.custom_logits import CustomLogitsStep
from vllm_lite.sample.metadata import SamplingMetadata
from vllm_lite.sample.ops.grammar_mask import GrammarBitmask, apply_grammar_bitmask
from vllm_lite.sample.ops.logits_bias import (apply_allowed_tokens, apply_bad_words, apply_logit_bias,
                                              apply_min_tokens)
from vllm_lite.sample.ops.logprobs import (LogprobsTensors, compute_logprobs, gather_logprobs,
                                           with_requested_ids)
from vllm_lite.sample.ops.penalties import apply_penalties
from vllm_lite.sample.ops.topk_topp import apply_min_p
from vllm_lite.sample.ops.topk_topp import sample as random_sample
from vllm_lite.sample.ops.topk_topp import sample_truncated, truncate
from vllm_lite.sample.seeded_draws import SeededRows


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_rows]
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs
    logprobs_rows: np.ndarray | None = None  # the rows `logprobs` holds; None = all rows
    # Rows whose allowed_token_ids / bad words (with a grammar's bitmask) left no token: their
    # draws are void, their requests fail (`emptied_rows`).
    emptied_rows: np.ndarray | None = None


class Sampler:
    """`logprobs_mode` (vLLM's): what a row's logprobs are: of the model's own distribution
    ("raw_logprobs", the default) or its logits ("raw_logits"), or of the distribution the token
    is drawn from ("processed_logprobs") or its logits ("processed_logits"): after min_tokens,
    logit_bias and penalties, and for random rows temperature, min-p and the top-k / top-p
    truncation (-inf outside)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.processed = logprobs_mode.startswith("processed")

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 grammar: GrammarBitmask | None = None, custom: CustomLogitsStep | None = None) -> SamplerOutput:
        """logits [num_rows, vocab] -> sampled token ids (and logprobs when asked).
        `grammar`: the allowed tokens of the structured-output rows (None: no such row).
        `custom`: the engine's custom logits processors (None: it has none)."""
        if grammar is not None:  # as in vLLM, before everything else (logprobs included)
            logits = logits.to(torch.float32)  # no-op for float32 logits
            apply_grammar_bitmask(logits, grammar)
        # Only for the rows that asked; raw ones before any processing.
        asked = metadata.logprobs_rows
        wanted = metadata.max_num_logprobs >= 0
        index = None if asked is None or not wanted else host_to_device(asked, logits.device)
        values = self._values(logits, index) if wanted and not self.processed else None
        if metadata.needs_logits_processing or not metadata.all_greedy or (custom is not None
                                                                              and custom.non_argmax_invariant):
            logits = logits.to(torch.float32)  # no-op for float32 logits
            self._process_logits(logits, metadata, None if grammar is None else grammar.logits_rows, custom)
        emptied = emptied_rows(logits, metadata)
        if wanted and self.processed:
            sampled, values = self._sample_processed(logits, metadata, index, custom)
        else:
            sampled = self._sample(logits, metadata, custom)
        if values is None:
            return SamplerOutput(sampled, None, emptied_rows=emptied)
        chosen = sampled if index is None else sampled.index_select(0, index)
        logprobs = gather_logprobs(values, metadata.max_num_logprobs, chosen)
        requested = metadata.requested_logprobs
        if requested is not None:  # rows with logprob_token_ids: their ids instead of the top-k
            logprobs = with_requested_ids(logprobs, values, requested.rows, requested.token_ids)
        return SamplerOutput(sampled, logprobs, asked, emptied)

    @staticmethod
    def takes_argmax_only(metadata: SamplingMetadata, custom: CustomLogitsStep | None = None) -> bool:
        """Whether sampling these rows is their logits' argmax and nothing else: all greedy, no
        logprobs, nothing that edits the logits (a grammar's bitmask is the caller's to check;
        custom processors that cannot change an argmax do not count). The model may then give
        the tokens without the logits (`compute_greedy_tokens`)."""
        return (metadata.all_greedy and not metadata.needs_logits_processing and metadata.max_num_logprobs < 0
                and metadata.requested_logprobs is None and (custom is None or not custom.non_argmax_invariant))

    def _values(self, logits: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """The asked rows' logprobs, or logits (a copy: sampling goes on in place), float32."""
        rows = logits if index is None else logits.index_select(0, index)
        if self.logprobs_mode.endswith("logprobs"):
            return compute_logprobs(rows)
        return rows.to(torch.float32, copy=index is None)

    def _sample_processed(self, logits: torch.Tensor, metadata: SamplingMetadata, index: torch.Tensor | None,
                          custom: CustomLogitsStep | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`_sample` with the truncation written into the logits, whose values are taken just
        before the draw (greedy rows of a mixed batch: at temperature 1, as in vLLM)."""
        if metadata.all_greedy:
            return greedy_tokens(logits), self._values(logits, index)
        greedy = None if metadata.all_random else greedy_tokens(logits)
        self._temper(logits, metadata, custom)
        truncate(logits, metadata.top_k, metadata.top_p, metadata.top_k_host, metadata.top_p_host)
        values = self._values(logits, index)
        sampled = sample_truncated(logits, self._uniforms(logits.shape[0], metadata.seeded, logits.device))
        return (sampled if greedy is None else torch.where(metadata.greedy_mask, greedy, sampled)), values

    @staticmethod
    def _process_logits(logits: torch.Tensor, metadata: SamplingMetadata,
                        grammar_rows: torch.Tensor | None, custom: CustomLogitsStep | None = None) -> None:
        if metadata.allowed_tokens is not None:  # vLLM's order: the whitelist first
            apply_allowed_tokens(logits, metadata.allowed_tokens)
        if metadata.bad_words is not None:
            apply_bad_words(logits, metadata.bad_words)
        if metadata.min_tokens is not None:
            apply_min_tokens(logits, metadata.min_tokens, grammar_rows)
        if metadata.logit_bias is not None:
            apply_logit_bias(logits, metadata.logit_bias)
        if custom is not None:
            custom.apply(logits, custom.non_argmax_invariant)
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                custom: CustomLogitsStep | None = None) -> torch.Tensor:
        if metadata.all_greedy:
            return greedy_tokens(logits)
        greedy = None if metadata.all_random else greedy_tokens(logits)
        self._temper(logits, metadata, custom)
        uniforms = self._uniforms(logits.shape[0], metadata.seeded, logits.device)
        sampled = random_sample(logits, metadata.top_k, metadata.top_p, uniforms,
                                metadata.top_k_host, metadata.top_p_host)
        if greedy is None:
            return sampled
        return torch.where(metadata.greedy_mask, greedy, sampled)

    @staticmethod
    def _temper(logits: torch.Tensor, metadata: SamplingMetadata, custom: CustomLogitsStep | None = None) -> None:
        if metadata.temperature is not None:
            logits.div_(metadata.temperature)
        if metadata.min_p is not None:
            apply_min_p(logits, metadata.min_p)
        if custom is not None:
            custom.apply(logits, custom.argmax_invariant)

    @staticmethod
    def _uniforms(num_rows: int, seeded: SeededRows | None, device: torch.device) -> torch.Tensor:
        """One uniform number per row; seeded rows take theirs from their seed and position
        (seeded_draws.py), so their tokens depend on nothing else in the batch or the step."""
        uniforms = torch.rand(num_rows, device=device)
        if seeded is not None:
            uniforms[seeded.logits_rows] = seeded.uniforms(device)
        return uniforms


def emptied_rows(logits: torch.Tensor, metadata: SamplingMetadata) -> np.ndarray | None:
    """The logits rows that allowed_token_ids and bad words (on top of a grammar's bitmask) left
    all -inf, ascending; None when there is none. Only the rows with those constraints are read:
    the only masks that can empty a row the request checks and the grammar's own check
    (`GrammarDeadEnd`) let through."""
    parts = []
    if metadata.allowed_tokens is not None:
        parts.append(metadata.allowed_tokens.rows)
    if metadata.bad_words is not None and metadata.bad_words.logits_rows:
        parts.append(host_to_device(np.asarray(metadata.bad_words.logits_rows, dtype=np.int64), logits.device))
    if not parts:
        return None
    rows = torch.unique(torch.cat(parts))
    alive = (logits.index_select(0, rows) > float("-inf")).any(dim=1)
    if bool(alive.all()):
        return None
    return rows[~alive].cpu().numpy()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary; on CPU the native op when it is built (torch's argmax is
    single-threaded and a sizeable part of a small model's step)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and cpu_native.is_available()):
        return cpu_native.argmax_rows(logits)
    return logits.argmax(dim=-1)
