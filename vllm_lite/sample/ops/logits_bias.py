"""logit_bias and min_tokens: additive edits to a few (row, token) entries of the logits."""

from __future__ import annotations

import torch

from vllm_lite.sample.metadata import LogitBiasMetadata, MinTokensMetadata


def apply_logit_bias(logits: torch.Tensor, bias: LogitBiasMetadata) -> None:
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, min_tokens: MinTokensMetadata) -> None:
    """-inf on EOS and stop_token_ids for rows with fewer than min_tokens outputs so far."""
    history = min_tokens.history
    rows = min_tokens.batch_rows
    num_output = history.num_tokens[rows] - history.num_prompt_tokens[rows]
    active = (num_output < min_tokens.min_tokens)[min_tokens.pair_index]
    if not active.any():
        return
    device = logits.device
    logits_rows = torch.from_numpy(min_tokens.pair_logits_rows[active]).to(device)
    token_ids = torch.from_numpy(min_tokens.pair_token_ids[active]).to(device)
    logits.index_put_((logits_rows, token_ids), torch.tensor(float("-inf"), device=device))
