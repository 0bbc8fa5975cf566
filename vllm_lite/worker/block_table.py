"""Per-row block ids of the persistent batch, in a numpy buffer reused across steps."""

from __future__ import annotations

import numpy as np

from vllm_lite.bookkeeping import chosen_loops
from vllm_lite.ragged import segment_offsets


class BlockTable:
    """Invariant: `block_ids[row, :num_blocks[row]]` are the row's blocks in sequence order;
    entries past `num_blocks[row]` are stale and never read."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, native: bool | None = None) -> None:
        """`native`: whether `append_rows` runs csrc's loop (None: where it is built; True: it must be)."""
        self.block_ids = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self._native = chosen_loops(native)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int] | np.ndarray) -> None:
        if len(block_ids) == 0:
            return
        start = int(self.num_blocks[row])
        if start + len(block_ids) > self.block_ids.shape[1]:
            raise ValueError(f"row {row} holds {start} blocks: {len(block_ids)} more exceed its "
                             f"{self.block_ids.shape[1]}")
        self.block_ids[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_rows(self, rows: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """`append_row` for each of `rows` (distinct, int64), row i taking the next `counts[i]`
        (int32, 0 or more) of `block_ids`: one C loop (`block_rows_append`) where csrc is built,
        else two array assignments for the whole step. All or nothing: a row that would
        overflow raises before anything is written."""
        if self._native is not None:
            self._native.block_rows_append(rows, counts, block_ids, self.block_ids, self.num_blocks)
            return
        starts = self.num_blocks[rows]
        ends = starts + counts
        if int(ends.max(initial=0)) > self.block_ids.shape[1]:
            row = int(rows[np.argmax(ends)])
            raise ValueError(f"row {row} holds {int(self.num_blocks[row])} blocks: more exceed its "
                             f"{self.block_ids.shape[1]}")
        self.block_ids[np.repeat(rows, counts), np.repeat(starts, counts) + segment_offsets(counts)] = block_ids
        self.num_blocks[rows] = ends

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

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The KV cache slot of each token (int64): the token at `positions[i]` of batch row
        `rows[i]`, in that row's block for the position."""
        return (self.block_ids[rows, positions // block_size].astype(np.int64) * block_size
                + positions % block_size)
