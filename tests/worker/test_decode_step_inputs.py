"""The worker's steady-step loops in csrc (vllm_lite._bookkeeping) against their numpy code on the
same batch: the decode step's inputs (`ModelRunner._decode_step_inputs`: `decode_inputs` and
`copy_block_rows`, against the general path of `_prepare_inputs`: every input tensor and
attention field the same, on random batches: lengths, block tables, a row whose token is not its
last, rows not all scheduled) and the sampled tokens counted and taken (`sampled_count`,
`sampled_write`); and the C loops' own refusals of what they cannot index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from scheduler_fakes import NEEDS_NATIVE_LOOPS
from vllm_lite.attention.backend import CommonAttentionMetadata
from vllm_lite.config import EngineArgs
from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.bookkeeping import native_loops
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire.worker import ModelRunnerOutput
from vllm_lite.worker.model_runner import LaunchedStep, ModelRunner

pytestmark = NEEDS_NATIVE_LOOPS

BLOCK_SIZE = 16
MAX_MODEL_LEN = 96


@pytest.fixture()
def runner(tiny_llama: Path) -> ModelRunner:
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                        block_size=BLOCK_SIZE).create_engine_config()
    return ModelRunner(config, torch.device("cpu"))


class CountingLoops:
    """csrc's loops, counting the calls of `decode_inputs` that built a step."""

    def __init__(self) -> None:
        self.steps_built = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(native_loops, name)

    def decode_inputs(self, *args: Any) -> int:
        longest = native_loops.decode_inputs(*args)
        self.steps_built += longest >= 0
        return longest


def inputs_of(runner: ModelRunner, sched: SchedulerOutput, loops: Any) -> dict[str, Any]:
    """Everything `_prepare_inputs` hands the model and the attention backend, copied (the kept
    tensors are overwritten by the next call)."""
    seen: list[CommonAttentionMetadata] = []
    build = runner.attn_backend.build
    runner.attn_backend.build = lambda common: seen.append(common) or build(common)
    runner.native_loops = loops
    try:
        inputs = runner._prepare_inputs(sched)
    finally:
        runner.attn_backend.build = build
    common = seen[0]
    return {
        "input_ids": inputs.input_ids.clone(), "positions": inputs.positions.clone(),
        "logits_indices": inputs.logits_indices.clone(), "sample_rows": inputs.sample_rows.copy(),
        "every_token_samples": inputs.every_token_samples, "rows": inputs.rows.copy(),
        "query_starts": inputs.query_starts.copy(), "query_lens": inputs.query_lens.copy(),
        "query_start_loc": common.query_start_loc.clone(), "seq_lens": common.seq_lens.clone(),
        "block_table": common.block_table.clone(), "slot_mapping": common.slot_mapping.clone(),
        "seq_lens_np": np.array(common.seq_lens_np), "num_actual_tokens": common.num_actual_tokens,
        "max_query_len": common.max_query_len,
    }


def assert_same_inputs(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert ours[name].dtype == value.dtype, name
            assert torch.equal(ours[name], value), name
        elif isinstance(value, np.ndarray):
            assert ours[name].dtype == value.dtype, name
            np.testing.assert_array_equal(ours[name], value, err_msg=name)
        else:
            assert ours[name] == value, name


def admit_last_token_steps(runner: ModelRunner, rng: np.random.Generator, num_requests: int) -> list[str]:
    """Requests joining with every token but their last computed: each one's step computes its
    last token (a decode step's shape), with random lengths and block ids."""
    req_ids = [f"r{i}" for i in range(num_requests)]
    new = []
    for req_id in req_ids:
        length = int(rng.integers(1, MAX_MODEL_LEN - 8))
        tokens = rng.integers(0, 100, length).astype(np.int32)
        blocks = rng.integers(1, 500, -(-length // BLOCK_SIZE)).tolist()
        new.append(NewRequestData(req_id, tokens, length, SamplingParams(), blocks, length - 1))
    sched = SchedulerOutput(new, CachedRequestData.empty(), dict.fromkeys(req_ids, 1), num_requests,
                            frozenset(), frozenset())
    assert runner._update_states(sched) is None
    return req_ids


def next_decode_step(runner: ModelRunner, rng: np.random.Generator, req_ids: list[str]) -> SchedulerOutput:
    """The batch takes a sampled token for each row; the next step computes it, with a new block
    for the rows whose token starts one."""
    batch = runner.input_batch
    rows = np.arange(batch.num_reqs)
    runner._append_sampled(rows, rng.integers(0, 100, len(rows)).astype(np.int32))
    computed = batch.num_computed_tokens[rows] + 1
    new_blocks = (computed % BLOCK_SIZE == 0).astype(np.int32)
    cached = CachedRequestData(req_ids, computed, new_blocks,
                               rng.integers(1, 500, int(new_blocks.sum())).astype(np.int32))
    return SchedulerOutput([], cached, dict.fromkeys(req_ids, 1), len(req_ids), frozenset(), frozenset())


@pytest.mark.parametrize("seed", range(4))
def test_decode_steps_match_the_general_path(runner: ModelRunner, seed: int) -> None:
    rng = np.random.default_rng(seed)
    req_ids = admit_last_token_steps(runner, rng, int(rng.integers(1, 17)))
    sched = SchedulerOutput([], CachedRequestData.empty(), dict.fromkeys(req_ids, 1), len(req_ids),
                            frozenset(), frozenset())
    loops = CountingLoops()
    for step in range(6):
        reference = inputs_of(runner, sched, None)
        assert_same_inputs(inputs_of(runner, sched, loops), reference)
        sched = next_decode_step(runner, rng, req_ids)
        assert runner._update_states(sched) is None
    assert loops.steps_built == 6  # (every step was the C loop's, none left to the general path)


def test_a_row_not_at_its_last_token_takes_the_general_path(runner: ModelRunner) -> None:
    rng = np.random.default_rng(7)
    req_ids = admit_last_token_steps(runner, rng, 5)
    batch = runner.input_batch
    batch.num_computed_tokens[2] -= 1  # row 2 computes a token before its last (a chunk of one)
    sched = SchedulerOutput([], CachedRequestData.empty(), dict.fromkeys(req_ids, 1), 5, frozenset(), frozenset())
    loops = CountingLoops()
    ours = inputs_of(runner, sched, loops)
    assert loops.steps_built == 0
    assert ours["sample_rows"].tolist() == [0, 1, 3, 4]
    assert_same_inputs(ours, inputs_of(runner, sched, None))


def test_rows_not_all_scheduled_take_the_general_path(runner: ModelRunner) -> None:
    rng = np.random.default_rng(8)
    req_ids = admit_last_token_steps(runner, rng, 6)
    some = [req_ids[i] for i in (0, 2, 5)]
    sched = SchedulerOutput([], CachedRequestData.empty(), dict.fromkeys(some, 1), 3, frozenset(), frozenset())
    loops = CountingLoops()
    ours = inputs_of(runner, sched, loops)
    assert loops.steps_built == 0
    assert ours["rows"].tolist() == [0, 2, 5]
    assert_same_inputs(ours, inputs_of(runner, sched, None))


def decode_arrays(n: int, width: int = 4) -> dict[str, np.ndarray]:
    computed = np.arange(n, dtype=np.int32) * 5
    return {
        "num_computed": computed, "num_tokens": computed + 1, "last_token_ids": np.arange(n, dtype=np.int32),
        "block_ids": np.arange(n * width, dtype=np.int32).reshape(n, width),
        "positions": np.empty(n, np.int64), "seq_lens": np.empty(n, np.int32),
        "slot_mapping": np.empty(n, np.int64), "input_ids": np.empty(n, np.int64),
    }


def call_decode_inputs(arrays: dict[str, np.ndarray], block_size: int) -> int:
    a = arrays
    return native_loops.decode_inputs(a["num_computed"], a["num_tokens"], a["last_token_ids"], a["block_ids"],
                                      block_size, a["positions"], a["seq_lens"], a["slot_mapping"], a["input_ids"])


def test_decode_inputs_arithmetic() -> None:
    arrays = decode_arrays(4)  # positions 0, 5, 10, 15 with blocks of 4: blocks 0, 1, 2, 3 of rows 0..3
    assert call_decode_inputs(arrays, 4) == 16
    assert arrays["positions"].tolist() == [0, 5, 10, 15]
    assert arrays["seq_lens"].tolist() == [1, 6, 11, 16]
    assert arrays["slot_mapping"].tolist() == [0 * 4 + 0, 5 * 4 + 1, 10 * 4 + 2, 15 * 4 + 3]
    assert arrays["input_ids"].tolist() == [0, 1, 2, 3]
    table = np.empty((3, 2), np.int32)
    native_loops.copy_block_rows(arrays["block_ids"], table)
    assert table.tolist() == [[0, 1], [4, 5], [8, 9]]


def test_decode_inputs_refuses_what_it_cannot_index() -> None:
    with pytest.raises(IndexError, match="row 2 at position 10 needs block 2, past its 2 columns"):
        call_decode_inputs(decode_arrays(4, width=2), 4)
    with pytest.raises(ValueError, match="block_size must be positive"):
        call_decode_inputs(decode_arrays(2), 0)
    short = decode_arrays(3)
    short["seq_lens"] = np.empty(2, np.int32)
    with pytest.raises(ValueError, match="entries where 3 are needed"):
        call_decode_inputs(short, 4)
    few_rows = decode_arrays(3)
    few_rows["num_tokens"] = few_rows["num_tokens"][:2]
    with pytest.raises(ValueError, match="2 rows where 3 are needed"):
        call_decode_inputs(few_rows, 4)
    wrong_type = decode_arrays(2)
    wrong_type["num_computed"] = wrong_type["num_computed"].astype(np.int64)
    with pytest.raises(TypeError, match="num_computed"):
        call_decode_inputs(wrong_type, 4)
    with pytest.raises(ValueError, match="a 3 x 5 table from 4 x 4"):
        native_loops.copy_block_rows(decode_arrays(4)["block_ids"], np.empty((3, 5), np.int32))


def batch_state(runner: ModelRunner) -> dict[str, np.ndarray]:
    batch = runner.input_batch
    return {name: getattr(batch, name).copy() for name in ("token_ids", "num_tokens", "last_token_ids", "row_serial")}


def count_and_take(runner: ModelRunner, loops: Any, rows: np.ndarray, tokens: np.ndarray
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A step's sampled tokens for `rows` counted (`_count_sampled`) then taken into the batch and
    a fresh output (`finish`), with `loops` (None: the numpy code): what was counted and the
    batch and output after."""
    runner.native_loops = loops
    sampled = runner._count_sampled(rows, torch.from_numpy(tokens))
    runner.unfinished = sampled  # (no step launched since: CPU)
    num_rows = runner.input_batch.num_reqs
    output = ModelRunnerOutput(runner.input_batch.live_req_ids, np.zeros((num_rows, 1), dtype=np.int32),
                               np.zeros(num_rows, dtype=np.int32))
    runner.finish(LaunchedStep(output, sampled, None, None))
    counted = {"positions": sampled.positions, "serials": sampled.serials}
    return counted, {**batch_state(runner), "sampled": output.sampled_token_ids, "num_sampled": output.num_sampled,
                     "every_row_sampled": np.array(output.every_row_sampled)}


@pytest.mark.parametrize("seed", range(3))
def test_sampled_tokens_counted_and_taken_as_the_numpy_code_does(runner: ModelRunner, seed: int) -> None:
    """`_count_sampled` and `finish` through csrc's `sampled_count` / `sampled_write` against
    their numpy code on the same batch: every row or some (ascending), int64 tokens (CPU) or
    int32 (a GPU's host copy), over several steps; the output says whether every row sampled."""
    rng = np.random.default_rng(seed)
    admit_last_token_steps(runner, rng, int(rng.integers(2, 17)))
    num_rows = runner.input_batch.num_reqs
    for step in range(4):
        rows = np.arange(num_rows) if step % 2 == 0 else np.flatnonzero(rng.integers(0, 2, num_rows))
        tokens = rng.integers(0, 100, len(rows)).astype(np.int64 if step < 2 else np.int32)
        before = batch_state(runner)
        reference = count_and_take(runner, None, rows, tokens)
        for name, value in before.items():
            getattr(runner.input_batch, name)[:] = value
        ours = count_and_take(runner, native_loops, rows, tokens)
        for got, want in zip(ours, reference):
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].dtype == want[name].dtype, (step, name)
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step}: {name}")
        assert ours[1]["num_sampled"][rows].tolist() == [1] * len(rows)
        assert bool(ours[1]["every_row_sampled"]) == (len(rows) == num_rows)  # (the engine core then skips looking)


def test_sampled_loops_refuse_what_they_cannot_index_and_write_nothing() -> None:
    num_tokens, serial = np.array([3, 0], dtype=np.int32), np.array([7, 8], dtype=np.int64)
    positions, serials = np.empty(2, np.int32), np.empty(2, np.int64)
    with pytest.raises(IndexError, match="sampled_count: row 2 out of range 0..1"):
        native_loops.sampled_count(np.array([0, 2]), num_tokens, serial, positions, serials)
    assert num_tokens.tolist() == [3, 0]
    native_loops.sampled_count(np.array([0, 1]), num_tokens, serial, positions, serials)
    assert (positions.tolist(), serials.tolist(), num_tokens.tolist()) == ([3, 0], [7, 8], [4, 1])
    token_ids, last = np.zeros((2, 4), np.int32), np.zeros(2, np.int32)
    sampled, num_sampled = np.zeros((2, 1), np.int32), np.zeros(2, np.int32)
    tokens = np.array([5, 6])
    with pytest.raises(IndexError, match="sampled_write: row 1 position 4 out of range 0..3"):
        native_loops.sampled_write(np.array([0, 1]), np.array([1, 4], np.int32), tokens, token_ids, last, sampled,
                                   num_sampled)
    with pytest.raises(IndexError, match="sampled_write: row -1 out of range"):
        native_loops.sampled_write(np.array([0, -1]), np.array([1, 1], np.int32), tokens, token_ids, last, sampled,
                                   num_sampled)
    assert not (token_ids.any() or last.any() or sampled.any() or num_sampled.any())
    native_loops.sampled_write(np.array([0, 1]), np.array([1, 3], np.int32), tokens, token_ids, last, sampled,
                               num_sampled)
    assert token_ids.tolist() == [[0, 5, 0, 0], [0, 0, 0, 6]] and last.tolist() == [5, 6]
    assert sampled.tolist() == [[5], [6]] and num_sampled.tolist() == [1, 1]
