"""Random sampling with min-p, top-k and top-p, vectorized over the batch.

Every random row draws exactly one uniform number u per step (from its own generator when it
has a seed) and takes the first token, in vocabulary order, whose cumulative kept probability
exceeds u times the kept mass. A row's token therefore depends only on its own logits, its own
parameters and its own u, never on the other rows of the batch or their order.

Truncation keeps the tokens whose probability is at least a threshold (ties at a threshold are
all kept): top-k's is the k-th largest probability, top-p's the largest t such that the tokens
with p >= t hold at least top_p of the top-k-kept mass. The cost is bounded whatever the
distribution: on CPU the native op draws every row, untruncated ones too, and finds both
thresholds by selection (expected O(vocab) per row); elsewhere one sort per row (a top-k alone
needs only a partial top-k): on a GPU every row, an untruncated one keeping every token, so that
which rows to work on is never read back from the device (a sync that would stall a step thread
launching ahead); the host's copies of top-k and top-p choose the work.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_lite import _custom_ops as cpu_native


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with p < min_p * p_max. In logit space that is
    `logit < logit_max + log(min_p)`, which needs no softmax (log(0) = -inf keeps all)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def sample(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
           uniforms: torch.Tensor, top_k_host: np.ndarray | None = None,
           top_p_host: np.ndarray | None = None) -> torch.Tensor:
    """logits: float32 [n, vocab] (temperature applied); top_k int64 [n] (0 = off); top_p
    float32 [n] (1.0 = off); uniforms float32 [n] in [0, 1). Returns int64 [n]. `top_k_host`,
    `top_p_host`: the same values on the host, from which the work is chosen without reading the
    device (read from it when not given)."""
    if _native_applies(logits):  # untruncated rows too: torch's softmax + cumsum cost 5x more
        top_k, top_p, _, _ = _both(logits, top_k, top_p, top_k_host, top_p_host)
        return cpu_native.top_k_top_p_sample(logits, top_k.contiguous(), top_p.contiguous(),
                                             uniforms.contiguous())
    truncate(logits, top_k, top_p, top_k_host, top_p_host)
    return sample_truncated(logits, uniforms)


def _both(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
          top_k_host: np.ndarray | None, top_p_host: np.ndarray | None) -> tuple:
    """top-k and top-p for every row (the one not given: off), on the device and the host."""
    n = logits.shape[0]
    if top_k is None:
        top_k, top_k_host = torch.zeros(n, dtype=torch.long, device=logits.device), np.zeros(n, dtype=np.int64)
    if top_p is None:
        top_p, top_p_host = torch.ones(n, device=logits.device), np.ones(n, dtype=np.float32)
    return top_k, top_p, top_k_host, top_p_host


def truncate(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
             top_k_host: np.ndarray | None = None, top_p_host: np.ndarray | None = None) -> None:
    """Sets the logits outside each row's top-k / top-p to -inf, in place (`sample`'s rule; the
    native op samples without writing them)."""
    if top_k is None and top_p is None:
        return
    top_k, top_p, top_k_host, top_p_host = _both(logits, top_k, top_p, top_k_host, top_p_host)
    k_host = top_k.cpu().numpy() if top_k_host is None else top_k_host
    p_host = top_p.cpu().numpy() if top_p_host is None else top_p_host
    truncated = (k_host > 0) | (p_host < 1.0)
    if truncated.all() or logits.device.type != "cpu":
        # (A row without truncation keeps every token under the rule, so off the CPU, where the
        # subset's index would have to travel to the device, every row takes part.)
        mask_top_k_top_p(logits, top_k, top_p, _max_k(k_host, logits.shape[1]), bool((p_host >= 1.0).all()))
    else:
        rows = np.flatnonzero(truncated)
        index = torch.from_numpy(rows)
        sub = logits.index_select(0, index)
        mask_top_k_top_p(sub, top_k[index], top_p[index], _max_k(k_host[rows], logits.shape[1]),
                         bool((p_host[rows] >= 1.0).all()))
        logits.index_copy_(0, index, sub)


def _max_k(top_k: np.ndarray, vocab: int) -> int:
    """The largest number of tokens a row's top-k keeps (0 = off keeps the whole vocabulary)."""
    return vocab if (top_k <= 0).any() else min(int(top_k.max()), vocab)


def _native_applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and cpu_native.is_available())


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     max_k: int | None = None, top_p_off: bool | None = None) -> None:
    """Sets the logits of the tokens outside each row's top-k / top-p to -inf, in place (the
    torch rule the native op also follows, see the module docstring). `max_k` (the largest
    kept count) and `top_p_off` (no row has a top-p) are read from the device when not given."""
    vocab = logits.shape[1]
    probs = logits.softmax(dim=-1)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    if top_p_off is None:
        top_p_off = bool((top_p >= 1.0).all())
    if top_p_off:
        ranked = probs.topk(int(k.max()) if max_k is None else max_k, dim=-1).values  # most likely first
        threshold = ranked.gather(1, (k - 1).unsqueeze(1))
    else:
        ranked = probs.sort(dim=-1, descending=True).values
        k_threshold = ranked.gather(1, (k - 1).unsqueeze(1))
        kept_mass = (ranked * (ranked >= k_threshold)).cumsum_(dim=-1)
        boundary = torch.searchsorted(kept_mass, top_p.unsqueeze(1) * kept_mass[:, -1:])
        p_threshold = ranked.gather(1, boundary.clamp_(max=vocab - 1))
        threshold = torch.where(top_p.unsqueeze(1) < 1.0, torch.maximum(k_threshold, p_threshold),
                                k_threshold)
    logits.masked_fill_(probs < threshold, float("-inf"))


def sample_truncated(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the vocabulary in its own order (logits already truncated, or not to be)."""
    cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
    return _search(cdf, uniforms).clamp_(max=logits.shape[1] - 1)


def _search(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative value exceeds u * total (total = last entry)."""
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1)
