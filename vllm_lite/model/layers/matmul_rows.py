"""Row counts rounded to a bounded set of sizes for oneDNN's CPU matmuls.

oneDNN (behind torch's packed CPU linear and `torch._int_mm`) builds one kernel per input shape
and keeps it in two LRU caches of 1,024 entries (oneDNN's primitive cache and ideep's, sized by
`ONEDNN_PRIMITIVE_CACHE_CAPACITY` and `LRU_CACHE_CAPACITY`). A build takes 2-4 ms and each kept
kernel about 100 KB. Serving traffic brings a new token count almost every step, so unpadded
row counts made the engine core's memory grow for thousands of requests (issue 12's soak) and
kept paying for builds. Rounding the rows up keeps the shapes to 16 per power of two, so every
kernel is built once and the caches stop growing: at most 1/16 more rows are computed, and
below 32 rows (decode, where the matmul reads weights and the rows cost nothing) none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

EXACT_ROWS = 32


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of 2**(bit_length - 5): 16 sizes per power of two."""
    if rows < EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def matmul_bucketed(flat: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`matmul(flat)` with `flat`'s rows zero-padded to `bucket_rows` on CPU; the padded rows of
    the result are dropped (a contiguous view)."""
    rows = flat.shape[0]
    padded = bucket_rows(rows)
    if padded == rows or flat.device.type != "cpu":
        return matmul(flat)
    return matmul(F.pad(flat, (0, 0, 0, padded - rows)))[:rows]
