"""logit_bias and min_tokens: additive edits to a few (row, token) entries of the logits;
allowed_token_ids: every other entry of a row masked; bad words: the (row, token) entries that
would complete one masked."""

from __future__ import annotations

import numpy as np
import torch

from vllm_lite.host_to_device import host_to_device
from vllm_lite.sample.metadata import (AllowedTokensMetadata, BadWordsMetadata, LogitBiasMetadata,
                                       MinTokensMetadata)


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokensMetadata) -> None:
    rows = logits.index_select(0, allowed.rows).masked_fill_(allowed.disallowed, float("-inf"))
    logits.index_copy_(0, allowed.rows, rows)


def apply_bad_words(logits: torch.Tensor, bad_words: BadWordsMetadata) -> None:
    """-inf on each token that would complete a bad word: the row's output ends with the rest
    of the word (one tail read per row and prefix length)."""
    history = bad_words.history
    logits_rows: list[int] = []
    token_ids: list[int] = []
    for logits_row, row, by_length in zip(bad_words.logits_rows, bad_words.batch_rows, bad_words.words):
        end = int(history.num_tokens[row])
        num_output = end - int(history.num_prompt_tokens[row])
        for length, words in by_length.items():
            if length > num_output:
                continue
            tail = tuple(history.token_ids[row, end - length:end].tolist())
            for prefix, last in words:
                if prefix == tail:
                    logits_rows.append(logits_row)
                    token_ids.append(last)
    if logits_rows:
        device = logits.device
        index = (host_to_device(np.array(logits_rows, dtype=np.int64), device),
                 host_to_device(np.array(token_ids, dtype=np.int64), device))
        logits.index_put_(index, torch.full((), float("-inf"), device=device))


def apply_logit_bias(logits: torch.Tensor, bias: LogitBiasMetadata) -> None:
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, min_tokens: MinTokensMetadata,
                     grammar_rows: torch.Tensor | None = None) -> None:
    """-inf on EOS and stop_token_ids for rows with fewer than min_tokens outputs so far.
    `grammar_rows`: the logits rows of structured-output requests. One of them whose grammar
    allows nothing but its stop tokens (the value is complete) keeps them: as in vLLM, min_tokens
    yields to the grammar rather than leave the row nothing to sample, and the request ends
    with `stop` below min_tokens."""
    history = min_tokens.history
    rows = min_tokens.batch_rows
    num_output = history.num_tokens[rows] - history.num_prompt_tokens[rows]
    if min_tokens.output_offsets is not None:
        num_output = num_output + min_tokens.output_offsets
    active = (num_output < min_tokens.min_tokens)[min_tokens.pair_index]
    if not active.any():
        return
    device = logits.device
    logits_rows = host_to_device(min_tokens.pair_logits_rows[active], device)
    token_ids = host_to_device(min_tokens.pair_token_ids[active], device)
    saved = logits[logits_rows, token_ids] if grammar_rows is not None else None
    logits.index_put_((logits_rows, token_ids), torch.full((), float("-inf"), device=device))
    if grammar_rows is not None:
        _restore_emptied_rows(logits, logits_rows, token_ids, saved, grammar_rows)


def _restore_emptied_rows(logits: torch.Tensor, logits_rows: torch.Tensor, token_ids: torch.Tensor,
                          saved: torch.Tensor, grammar_rows: torch.Tensor) -> None:
    """Puts back the stop-token logits of constrained rows that the suppression left all -inf
    (only those rows are scanned)."""
    constrained = torch.isin(logits_rows, grammar_rows)
    if not constrained.any():
        return
    rows = torch.unique(logits_rows[constrained])
    emptied = rows[~(logits[rows] > float("-inf")).any(dim=1)]
    if emptied.numel() == 0:
        return
    restore = torch.isin(logits_rows, emptied)
    logits[logits_rows[restore], token_ids[restore]] = saved[restore]
