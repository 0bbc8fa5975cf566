"""Logprobs of chosen tokens plus the top-k of each row, with ranks (1 = most likely)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.wire import LogprobsArrays


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # int64 [n, k + 1]: the chosen token, then the top-k
    logprobs: torch.Tensor  # float32 [n, k + 1]
    ranks: torch.Tensor  # int64 [n, k + 1]

    def to_numpy(self) -> LogprobsArrays:
        return LogprobsArrays(
            token_ids=self.token_ids.to(torch.int32).cpu().numpy(),
            logprobs=self.logprobs.float().cpu().numpy(),
            ranks=self.ranks.to(torch.int32).cpu().numpy(),
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """`token_ids` [n] are the chosen tokens. A token's rank is the number of tokens at least as
    likely as it (vLLM's definition: ties share the worse rank)."""
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    token_ranks = (logprobs >= token_logprobs).sum(dim=-1, keepdim=True)
    if num_logprobs == 0:
        return LogprobsTensors(token_ids, token_logprobs, token_ranks)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    top_ranks = torch.arange(1, num_logprobs + 1, device=logprobs.device).expand(len(logprobs), -1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=torch.cat([token_ranks, top_ranks], dim=1),
    )


def with_requested_ids(gathered: LogprobsTensors, logprobs: torch.Tensor, rows: torch.Tensor,
                       token_ids: torch.Tensor) -> LogprobsTensors:
    """Rows `rows` of `logprobs` report the given `token_ids` [m, n] in columns 1..n (vLLM's
    logprob_token_ids) instead of the top-k, with their ranks over the whole vocabulary; the
    result is widened to n + 1 columns when the top-k is narrower."""
    width = max(gathered.token_ids.shape[1], token_ids.shape[1] + 1)
    out = LogprobsTensors(_widen(gathered.token_ids, width), _widen(gathered.logprobs, width),
                          _widen(gathered.ranks, width))
    row_logprobs = logprobs.index_select(0, rows)
    values = row_logprobs.gather(1, token_ids)
    ascending = row_logprobs.sort(dim=-1).values
    at_least_as_likely = row_logprobs.shape[1] - torch.searchsorted(ascending, values, side="left")
    columns = slice(1, token_ids.shape[1] + 1)
    out.token_ids[rows, columns] = token_ids
    out.logprobs[rows, columns] = values
    out.ranks[rows, columns] = at_least_as_likely
    return out


def _widen(values: torch.Tensor, width: int) -> torch.Tensor:
    if values.shape[1] == width:
        return values.clone()
    out = values.new_zeros((values.shape[0], width))
    out[:, : values.shape[1]] = values
    return out


def scatter_rows(arrays: LogprobsArrays, rows: np.ndarray, num_rows: int) -> LogprobsArrays:
    """Place per-sample rows at their batch rows (other rows zero)."""
    def place(values: np.ndarray) -> np.ndarray:
        out = np.zeros((num_rows, values.shape[1]), dtype=values.dtype)
        out[rows] = values
        return out

    return LogprobsArrays(place(arrays.token_ids), place(arrays.logprobs), place(arrays.ranks))
