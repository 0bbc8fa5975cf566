"""vLLM's n-gram speculative proposer (prompt lookup decoding): a request's draft tokens are the
ones that followed the latest n tokens of its sequence where those n tokens occurred before.

The longest n in [min_n, max_n] with an earlier occurrence wins; among its occurrences the
earliest (vLLM's rule); the draft is the (up to) k tokens after it. No model runs: the engine
core proposes from the token store while it schedules (core/scheduler.py), and the step computes
the drafts with the request's token; the worker keeps the drafts the model itself samples."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

NO_DRAFT = np.zeros(0, dtype=np.int32)
NO_DRAFT.flags.writeable = False


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` draft tokens following the earliest earlier occurrence of the longest suffix of
    `tokens` (1-D) of `min_n`..`max_n` tokens; empty when no such suffix occurred before. A view
    of `tokens` (the caller copies it where `tokens` may change)."""
    total = len(tokens)
    if k <= 0 or total <= min_n:
        return NO_DRAFT
    # Occurrences start at i with i + n <= total - 1: before the suffix's own place, and
    # followed by at least one token. A suffix of n matches at i only if its last min_n do at
    # i + n - min_n, so longer suffixes are checked only where the shortest matched.
    candidates = _matches(tokens[:total - 1], tokens[total - min_n:])  # starts of min_n-gram occurrences
    if len(candidates) == 0:
        return NO_DRAFT
    best_n, best_start = min_n, int(candidates[0])
    for n in range(min_n + 1, min(max_n, total - 1) + 1):
        starts = candidates - (n - min_n)  # where an n-gram ending like the min_n one would start
        starts = starts[starts >= 0]
        if len(starts) == 0:
            break
        extra = n - min_n  # the tokens in front of the min_n-gram that must match too
        suffix_head = tokens[total - n:total - min_n]
        heads = tokens[starts[:, None] + np.arange(extra)]
        matched = starts[(heads == suffix_head).all(axis=1)]
        if len(matched) == 0:
            break
        candidates = matched + extra
        best_n, best_start = n, int(matched[0])
    first = best_start + best_n
    return tokens[first:first + k]


def _matches(haystack: np.ndarray, needle: np.ndarray) -> np.ndarray:
    """Ascending starts of `needle` in `haystack` (both 1-D)."""
    n = len(needle)
    if len(haystack) < n:
        return np.zeros(0, dtype=np.int64)
    first = np.flatnonzero(haystack[:len(haystack) - n + 1] == needle[0])
    if n == 1 or len(first) == 0:
        return first
    windows = sliding_window_view(haystack, n)
    return first[(windows[first] == needle).all(axis=1)]
