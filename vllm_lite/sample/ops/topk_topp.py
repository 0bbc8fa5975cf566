"""Random sampling with min-p, top-k and top-p, vectorized over the batch.

Every random row draws exactly one uniform number u per step (from its own generator when it
has a seed) and takes the token where its cumulative distribution first exceeds u. A row's
token therefore depends only on its own logits, its own parameters and its own u, never on the
other rows of the batch or their order. Which order the distribution is walked in is a row's
own choice too: vocabulary order for untruncated rows, most-likely-first for top-k/top-p rows.

top-k/top-p start from a partial top-K instead of sorting the vocabulary: the kept tokens are the
most likely ones, so a top-K of K = 256 holds them all unless a row's nucleus is larger, in which
case that row alone is retried with a 4x larger K. Pure top-k takes K = the largest k. So the
whole vocabulary is sorted only for a row whose k or nucleus really spans it.
"""

from __future__ import annotations

import torch

INITIAL_CANDIDATES = 256


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with p < min_p * p_max. In logit space that is
    `logit < logit_max + log(min_p)`, which needs no softmax (log(0) = -inf keeps all)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def sample(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
           uniforms: torch.Tensor) -> torch.Tensor:
    """logits: float32 [n, vocab] (temperature applied); top_k int64 [n] (0 = off); top_p
    float32 [n] (1.0 = off); uniforms float32 [n] in [0, 1). Returns int64 [n]."""
    if top_k is None and top_p is None:
        return _sample_full(logits, uniforms)
    n = logits.shape[0]
    top_k = top_k if top_k is not None else torch.zeros(n, dtype=torch.long, device=logits.device)
    top_p = top_p if top_p is not None else torch.ones(n, device=logits.device)
    truncated = (top_k > 0) | (top_p < 1.0)
    if bool(truncated.all()):
        return _sample_top_k_top_p(logits, top_k, top_p, uniforms, INITIAL_CANDIDATES)
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    rows = truncated.nonzero().squeeze(1)
    out[rows] = _sample_top_k_top_p(logits[rows], top_k[rows], top_p[rows], uniforms[rows],
                                    INITIAL_CANDIDATES)
    rows = (~truncated).nonzero().squeeze(1)
    out[rows] = _sample_full(logits[rows], uniforms[rows])
    return out


def _sample_full(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over the vocabulary in its own order."""
    cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
    return _search(cdf, uniforms).clamp_(max=logits.shape[1] - 1)


def _sample_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        uniforms: torch.Tensor, num_candidates: int,
                        log_total: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest most-likely-first prefix whose mass
    reaches p (a token stays while the mass before it is < p, so the top token always does);
    draw from what is kept, renormalized. `log_total`: each row's logsumexp, if known."""
    vocab = logits.shape[1]
    if log_total is None:
        log_total = _logsumexp(logits)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    pure_top_k = bool((top_p >= 1.0).all())  # then max(k) candidates are exactly enough
    num = min(vocab, int(k.max()) if pure_top_k else num_candidates)
    values, token_ids = logits.topk(num, dim=-1)  # most likely first
    probs = (values - log_total).exp_()
    mass = probs.cumsum(dim=-1)
    positions = torch.arange(num, device=logits.device)
    keep = ((mass - probs) < top_p.unsqueeze(1)) & (positions < k.unsqueeze(1))
    kept_cdf = probs.mul_(keep).cumsum_(dim=-1)
    index = _search(kept_cdf, uniforms).clamp_(max=num - 1)
    out = token_ids.gather(1, index.unsqueeze(1)).squeeze(1)
    # A row whose last candidate is kept might keep tokens beyond the candidates: retry it wider.
    uncovered = keep[:, -1] & (k > num)
    if num < vocab and bool(uncovered.any()):
        rows = uncovered.nonzero().squeeze(1)
        out[rows] = _sample_top_k_top_p(logits[rows], top_k[rows], top_p[rows], uniforms[rows], 4 * num,
                                        log_total[rows])
    return out


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp spelled out: it makes the same full-size temporary, but inside one
    kernel, where LogitsCopyCounter could not see it."""
    peak = logits.amax(dim=-1, keepdim=True)
    return (logits - peak).exp_().sum(dim=-1, keepdim=True).log_().add_(peak)


def _search(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative value exceeds u * total (total = last entry)."""
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1)
