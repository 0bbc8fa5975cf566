"""Ragged batches as numpy arrays: segments of `counts[i]` elements laid end to end (a step's
tokens, row by row)."""

from __future__ import annotations

import numpy as np


def segment_offsets(counts: np.ndarray) -> np.ndarray:
    """Each element's offset within its segment, for segments of `counts` elements laid end to
    end: `[0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ..]` (int64)."""
    ends = np.cumsum(counts, dtype=np.int64)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) - np.repeat(ends - counts, counts)
