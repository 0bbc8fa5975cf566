"""Per-row block ids of the persistent batch, in a numpy buffer reused across steps."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Invariant: `block_ids[row, :num_blocks[row]]` are the row's blocks in sequence order;
    entries past `num_blocks[row]` are stale and never read."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        self.block_ids = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int] | np.ndarray) -> None:
        if len(block_ids) == 0:
            return
        start = self.num_blocks[row]
        self.block_ids[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> int:
        """Copy row `src` into row `dst`; returns the number of elements copied."""
        n = self.num_blocks[src]
        self.block_ids[dst, :n] = self.block_ids[src, :n]
        self.num_blocks[dst] = n
        return int(n)

    def swap_rows(self, a: int, b: int) -> int:
        """Swap rows `a` and `b`; returns the number of elements copied."""
        na, nb = int(self.num_blocks[a]), int(self.num_blocks[b])
        saved = self.block_ids[a, :na].copy()
        self.block_ids[a, :nb] = self.block_ids[b, :nb]
        self.block_ids[b, :na] = saved
        self.num_blocks[a], self.num_blocks[b] = nb, na
        return 2 * na + nb
