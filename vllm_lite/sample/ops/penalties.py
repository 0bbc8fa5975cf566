"""Repetition, frequency and presence penalties, as vLLM (and the OpenAI API) define them:

* repetition (HF/CTRL): for tokens seen in the prompt or the output, positive logits are divided
  by the penalty and negative ones multiplied by it;
* frequency: `logit -= frequency_penalty * count of the token in the output`;
* presence: `logit -= presence_penalty` if the token occurs in the output.

The occurrences are kept incrementally (`sample/occurrences.py`): a penalized request's prompt mask
and output counts are built once when it (re)enters the batch and then updated with the tokens
added since the last step, so a step's cost does not grow with the sequence length.
"""

from __future__ import annotations

import torch

from vllm_lite.sample.metadata import PenaltyMetadata


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> None:
    """In place on float32 logits; only the penalized rows are read or written."""
    # (rows with drafts before them are the only requests on several rows)
    prompt_mask, output_counts = penalties.occurrences.gather(
        penalties.req_ids, penalties.batch_rows, penalties.history, logits.shape[1],
        repeated=penalties.preceding is not None)
    if penalties.preceding is not None:  # (drafts before a row's position count as its outputs)
        rows, tokens = penalties.preceding
        output_counts = output_counts.index_put((rows, tokens), torch.ones(len(rows), device=output_counts.device),
                                                accumulate=True)
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
