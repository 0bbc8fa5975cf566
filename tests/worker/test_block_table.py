"""BlockTable.append_rows: a step's new blocks for many rows at once (csrc's `block_rows_append`
where it is built, else two array assignments; every test runs both), the same table as
`append_row` row by row, and nothing written when one row would overflow."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_fakes import EITHER_LOOPS, NEEDS_NATIVE_LOOPS
from vllm_lite.worker.block_table import BlockTable


def filled_table(rng: np.random.Generator, num_rows: int, width: int, native: bool) -> BlockTable:
    table = BlockTable(num_rows, width, native=native)
    for row in range(num_rows):
        table.add_row(row, rng.integers(1, 1000, int(rng.integers(0, width // 2))).tolist())
    return table


@EITHER_LOOPS
def test_append_rows_is_append_row_for_each_row(native: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        by_rows, one_by_one = (filled_table(np.random.default_rng(1), 16, 8, native) for _ in range(2))
        rows = np.sort(rng.choice(16, int(rng.integers(1, 17)), replace=False))
        counts = rng.integers(0, 4, len(rows)).astype(np.int32)  # (rows taking no block among them)
        block_ids = rng.integers(1, 1000, int(counts.sum())).astype(np.int32)
        by_rows.append_rows(rows, counts, block_ids)
        start = 0
        for row, count in zip(rows.tolist(), counts.tolist()):
            one_by_one.append_row(row, block_ids[start:start + count])
            start += count
        assert by_rows.num_blocks.tolist() == one_by_one.num_blocks.tolist()
        for row in range(16):
            n = int(one_by_one.num_blocks[row])
            assert by_rows.block_ids[row, :n].tolist() == one_by_one.block_ids[row, :n].tolist()


@EITHER_LOOPS
def test_a_row_that_would_overflow_leaves_every_row_as_it_was(native: bool) -> None:
    table = BlockTable(3, 4, native=native)
    for row, blocks in enumerate(([1], [2, 3, 4], [5])):
        table.add_row(row, blocks)
    before = table.block_ids.copy(), table.num_blocks.copy()
    with pytest.raises(ValueError, match="row 1 holds 3 blocks: more exceed its 4"):
        table.append_rows(np.array([0, 1, 2]), np.array([1, 2, 1], dtype=np.int32),
                          np.array([6, 7, 8, 9], dtype=np.int32))
    assert np.array_equal(table.block_ids, before[0]) and np.array_equal(table.num_blocks, before[1])
    with pytest.raises(ValueError, match="row 1 holds 3 blocks: 2 more exceed its 4"):
        table.append_row(1, [7, 8])


@NEEDS_NATIVE_LOOPS
def test_the_c_loop_refuses_counts_that_do_not_match_the_blocks_given() -> None:
    table = BlockTable(3, 4, native=True)
    before = table.block_ids.copy(), table.num_blocks.copy()
    with pytest.raises(ValueError, match="the counts take 3 blocks, 2 given"):
        table.append_rows(np.array([0, 2]), np.array([1, 2], dtype=np.int32), np.array([6, 7], dtype=np.int32))
    with pytest.raises(ValueError, match="row 2 takes -1 blocks"):
        table.append_rows(np.array([0, 2]), np.array([1, -1], dtype=np.int32), np.array([6], dtype=np.int32))
    with pytest.raises(IndexError, match="block_rows_append: row 3 out of range 0..2"):
        table.append_rows(np.array([3]), np.array([1], dtype=np.int32), np.array([6], dtype=np.int32))
    assert np.array_equal(table.block_ids, before[0]) and np.array_equal(table.num_blocks, before[1])
    # A row named twice (callers name each once) stops at its row's end, never writing into the next row.
    with pytest.raises(IndexError, match="block_rows_append: row 1 named twice, its row full"):
        table.append_rows(np.array([1, 1]), np.array([3, 3], dtype=np.int32), np.arange(6, dtype=np.int32))
    assert table.num_blocks.tolist() == [0, 3, 0] and not table.block_ids[2].any()
