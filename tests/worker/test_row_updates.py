"""A decode step's row updates in the worker: the batch rows of the step's requests are kept
between steps (`ModelRunner._batch_rows`) while the batch keeps its rows, and only the rows whose
block table grows (`CachedRequestData.num_new_blocks`) get new blocks, in one assignment. Whatever the batch
did in between (a request leaving, rows moved down by `condense`, a request that never joined),
every request's counter, block table and input position must be its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_lite.config import EngineArgs
from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.model_runner import ModelRunner

PROMPT_LEN = 5


@pytest.fixture()
def runner(tiny_llama: Path) -> ModelRunner:
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, max_num_seqs=8,
                        block_size=16).create_engine_config()
    return ModelRunner(config, torch.device("cpu"))


def admit(runner: ModelRunner, req_ids: list[str], first_block: dict[str, int]) -> None:
    new = [NewRequestData(r, np.arange(PROMPT_LEN, dtype=np.int32), PROMPT_LEN, SamplingParams(), [first_block[r]], 0)
           for r in req_ids]
    runner._update_states(SchedulerOutput(new, CachedRequestData.empty(), dict.fromkeys(req_ids, PROMPT_LEN),
                                          PROMPT_LEN * len(req_ids), frozenset(), frozenset()))


def decode_step(req_ids: list[str], computed: dict[str, int], new_blocks: dict[str, list[int]],
                finished: frozenset[str] = frozenset()) -> SchedulerOutput:
    block_lists = [new_blocks.get(r, []) for r in req_ids]
    cached = CachedRequestData(req_ids, np.array([computed[r] for r in req_ids]),
                               np.array([len(blocks) for blocks in block_lists], dtype=np.int32),
                               np.array([b for blocks in block_lists for b in blocks], dtype=np.int32))
    return SchedulerOutput([], cached, dict.fromkeys(req_ids, 1), len(req_ids), finished, frozenset())


def assert_rows_are_their_own(runner: ModelRunner, sched: SchedulerOutput, computed: dict[str, int],
                              blocks: dict[str, list[int]]) -> None:
    batch = runner.input_batch
    for req_id, row in batch.req_id_to_index.items():
        assert batch.num_computed_tokens[row] == computed[req_id], req_id
        table = batch.block_table
        assert table.block_ids[row, :table.num_blocks[row]].tolist() == blocks[req_id], req_id
    inputs = runner._prepare_inputs(sched)
    scheduled = [r for r in sched.scheduled_cached_reqs.req_ids if r in batch.req_id_to_index]
    assert sorted(inputs.rows.tolist()) == sorted(batch.req_id_to_index[r] for r in scheduled)
    for row, position in zip(inputs.rows.tolist(), inputs.positions.tolist()):
        assert position == computed[batch.req_ids[row]]


def test_kept_rows_follow_the_batch(runner: ModelRunner) -> None:
    ids = ["a", "b", "c", "d"]
    blocks = {r: [i + 1] for i, r in enumerate(ids)}
    admit(runner, ids, {r: b[0] for r, b in blocks.items()})
    computed = dict.fromkeys(ids, PROMPT_LEN)
    steps = [
        (ids, {"b": [11]}, frozenset()),  # first decode step: rows looked up
        (ids, {"c": [12, 13]}, frozenset()),  # the same list again: rows kept
        (["b", "c", "d"], {"d": [14]}, frozenset({"a"})),  # "a" leaves: "d" moves down to row 0
        (["b", "c", "d"], {}, frozenset()),  # rows looked up again after the move
        (["c", "d"], {"c": [15]}, frozenset({"b"})),
    ]
    for req_ids, new_blocks, finished in steps:
        for req_id in finished:
            del computed[req_id], blocks[req_id]
        sched = decode_step(req_ids, computed, new_blocks, finished)
        assert runner._update_states(sched) is None
        for req_id, added in new_blocks.items():
            blocks[req_id] = blocks[req_id] + added
        assert_rows_are_their_own(runner, sched, computed, blocks)
        computed = {r: n + 1 for r, n in computed.items()}


def test_a_request_missing_from_the_batch_is_passed_over(runner: ModelRunner) -> None:
    """Async scheduling can name a request the worker dropped when it failed: the step goes on
    for the others, through the per-request updates."""
    admit(runner, ["a", "b", "c"], {"a": 1, "b": 2, "c": 3})
    runner.input_batch.remove_request("b")
    runner.input_batch.condense()
    runner.dropped_failed.add("b")
    computed = dict.fromkeys(["a", "b", "c"], PROMPT_LEN)
    sched = decode_step(["a", "b", "c"], computed, {"c": [9]})
    assert runner._update_states(sched) is None
    assert_rows_are_their_own(runner, sched, computed, {"a": [1], "c": [3, 9]})


def test_the_same_counts_dict_is_read_again_once_the_batch_moves(runner: ModelRunner) -> None:
    """The scheduler hands a steady decode step's counts over as the same dict object each step;
    the worker keeps the step's rows for that dict only while the batch keeps its rows. Here
    requests outside the step leave between two steps that share the dict, moving the
    scheduled ones down: their inputs must follow."""
    ids = ["a", "b", "c", "d"]
    blocks = {r: [i + 1] for i, r in enumerate(ids)}
    admit(runner, ids, {r: b[0] for r, b in blocks.items()})
    computed = {"a": 0, "b": 0, "c": PROMPT_LEN, "d": PROMPT_LEN}  # (a and b never decode here)
    counts = dict.fromkeys(["c", "d"], 1)
    for leaving in ("a", "b"):
        del computed[leaving], blocks[leaving]
        step = decode_step(["c", "d"], computed, {}, frozenset({leaving}))
        sched = SchedulerOutput([], step.scheduled_cached_reqs, counts, 2, step.finished_req_ids, frozenset())
        assert runner._update_states(sched) is None
        assert_rows_are_their_own(runner, sched, computed, blocks)
        assert runner.input_batch.num_reqs == len(computed)
        computed = {r: n + 1 if r in counts else n for r, n in computed.items()}
