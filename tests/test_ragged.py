"""vllm_lite/ragged.py against the per-segment loop it stands for."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lite.ragged import segment_offsets


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_segment_offsets_count_from_zero_in_each_segment(dtype) -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 6, size=40).astype(dtype)  # empty segments included
    expected = [offset for count in counts.tolist() for offset in range(count)]
    offsets = segment_offsets(counts)
    assert offsets.dtype == np.int64
    assert offsets.tolist() == expected


def test_segment_offsets_of_no_segments_is_empty() -> None:
    assert segment_offsets(np.zeros(0, dtype=np.int64)).tolist() == []
    assert segment_offsets(np.zeros(3, dtype=np.int64)).tolist() == []
