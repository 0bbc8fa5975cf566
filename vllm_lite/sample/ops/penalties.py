"""Repetition, frequency and presence penalties, as vLLM (and the OpenAI API) define them:

* repetition (HF/CTRL): for tokens seen in the prompt or the output, positive logits are divided
  by the penalty and negative ones multiplied by it;
* frequency: `logit -= frequency_penalty * count of the token in the output`;
* presence: `logit -= presence_penalty` if the token occurs in the output.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_lite.sample.metadata import PenaltyMetadata


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> None:
    """In place on float32 logits; only the penalized rows are read or written."""
    prompt_mask, output_counts = token_occurrences(penalties, logits.shape[1], logits.device)
    if penalties.all_rows:
        penalize(logits, prompt_mask, output_counts, penalties.repetition, penalties.frequency,
                 penalties.presence)
        return
    rows = penalties.logits_rows
    sub = logits.index_select(0, rows)
    penalize(sub, prompt_mask, output_counts, penalties.repetition, penalties.frequency,
             penalties.presence)
    logits.index_copy_(0, rows, sub)


def penalize(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
             repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """The formulas, in place on [m, vocab] logits; penalties are [m, 1]."""
    output_mask = output_counts > 0
    scale = torch.where(prompt_mask | output_mask, repetition, 1.0)
    logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits.sub_(frequency * output_counts)
    logits.sub_(presence * output_mask)


def token_occurrences(penalties: PenaltyMetadata, vocab_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [m, vocab] token is in the prompt, float32 [m, vocab] count in the output)."""
    history = penalties.history
    rows = penalties.batch_rows
    num_prompt = history.num_prompt_tokens[rows][:, None]
    num_tokens = history.num_tokens[rows][:, None]
    max_len = int(num_tokens.max())
    tokens = history.token_ids[rows, :max_len].astype(np.int64)
    positions = np.arange(max_len)[None, :]
    # Out-of-range positions point at an extra column `vocab_size`, dropped afterwards.
    prompt_ids = np.where(positions < num_prompt, tokens, vocab_size)
    output_ids = np.where((positions >= num_prompt) & (positions < num_tokens), tokens, vocab_size)
    prompt_ids_t = torch.from_numpy(prompt_ids).to(device, non_blocking=True)
    output_ids_t = torch.from_numpy(output_ids).to(device, non_blocking=True)
    m = len(rows)
    prompt_mask = torch.zeros(m, vocab_size + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt_ids_t, True)
    output_counts = torch.zeros(m, vocab_size + 1, dtype=torch.float32, device=device)
    output_counts.scatter_add_(1, output_ids_t, torch.ones_like(output_ids_t, dtype=torch.float32))
    return prompt_mask[:, :vocab_size], output_counts[:, :vocab_size]
