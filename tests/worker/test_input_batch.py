from __future__ import annotations

import numpy as np
import pytest

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch


def new_request(i: int, num_tokens: int) -> NewRequestData:
    tokens = np.arange(num_tokens, dtype=np.int32) + 1000 * i
    blocks = list(range(10 * i, 10 * i + (num_tokens + 15) // 16))
    return NewRequestData(f"r{i}", tokens, num_tokens - 1, SamplingParams(temperature=0.1 * i),
                          blocks, num_tokens // 2)


def make_batch(max_model_len: int, lengths: list[int]) -> InputBatch:
    batch = InputBatch(max_num_reqs=16, max_model_len=max_model_len,
                       max_num_blocks_per_req=(max_model_len + 15) // 16)
    for i, n in enumerate(lengths):
        batch.add_request(new_request(i, n))
    return batch


def assert_row_holds(batch: InputBatch, row: int, i: int, num_tokens: int) -> None:
    expected = new_request(i, num_tokens)
    assert batch.req_ids[row] == expected.req_id and batch.req_id_to_index[expected.req_id] == row
    assert np.array_equal(batch.token_ids[row, :num_tokens], expected.token_ids)
    assert batch.num_tokens[row] == num_tokens
    assert batch.last_token_ids[row] == expected.token_ids[-1]  # (a decode step's input)
    assert batch.num_prompt_tokens[row] == expected.num_prompt_tokens
    assert batch.num_computed_tokens[row] == expected.num_computed_tokens
    assert batch.temperature[row] == np.float32(expected.sampling_params.temperature)
    n_blocks = batch.block_table.num_blocks[row]
    assert list(batch.block_table.block_ids[row, :n_blocks]) == expected.block_ids


LENGTHS = [5, 40, 17, 90, 3, 64]


def test_swap_states_keeps_every_row_right() -> None:
    batch = make_batch(256, LENGTHS)
    batch.swap_states(1, 3)
    batch.swap_states(0, 5)
    order = [5, 3, 2, 1, 4, 0]
    for row, i in enumerate(order):
        assert_row_holds(batch, row, i, LENGTHS[i])


def test_condense_fills_holes_with_the_last_rows() -> None:
    batch = make_batch(256, LENGTHS)
    batch.remove_request("r1")
    batch.remove_request("r4")
    batch.condense()
    assert batch.num_reqs == 4
    assert batch.live_req_ids == ["r0", "r5", "r2", "r3"]
    for row, i in enumerate([0, 5, 2, 3]):
        assert_row_holds(batch, row, i, LENGTHS[i])
    assert batch.live_req_ids == ["r0", "r5", "r2", "r3"]  # (the kept list follows the batch)
    batch.add_request(new_request(7, 12))
    assert_row_holds(batch, 4, 7, 12)
    assert batch.live_req_ids == ["r0", "r5", "r2", "r3", "r7"]


def test_rows_of_new_requests_do_not_depend_on_the_order_of_removal() -> None:
    """Under TP every rank removes the step's finished requests in its own set order (string
    hashing is seeded per process) and must still give each new request the same row."""
    layouts = []
    for removal_order in (["r0", "r2", "r4"], ["r4", "r0", "r2"], ["r2", "r4", "r0"]):
        batch = make_batch(256, LENGTHS)
        for req_id in removal_order:
            batch.remove_request(req_id)
        for i in (6, 7):
            batch.add_request(new_request(i, 9))
        batch.condense()
        layouts.append(batch.live_req_ids)
    assert layouts[0] == layouts[1] == layouts[2]


def test_a_request_that_cannot_be_written_leaves_the_batch_as_it_was() -> None:
    batch = make_batch(256, LENGTHS)
    batch.remove_request("r1")
    before = (list(batch.req_ids), batch.num_reqs, dict(batch.req_id_to_index))
    too_long = new_request(8, 300)  # longer than a row (max_model_len + 1)
    with pytest.raises(ValueError):
        batch.add_request(too_long)
    assert (list(batch.req_ids), batch.num_reqs, dict(batch.req_id_to_index)) == before
    batch.add_request(new_request(9, 12))  # the hole is still there for the next one
    batch.condense()
    assert batch.num_reqs == len(LENGTHS) and batch.req_id_to_index["r9"] == 1


def test_removing_the_tail_needs_no_moves() -> None:
    batch = make_batch(256, LENGTHS)
    moved = batch.num_elements_moved
    batch.remove_request("r5")
    batch.condense()
    assert batch.num_reqs == 5 and batch.num_elements_moved == moved


@pytest.mark.parametrize("operation", ["swap", "condense"])
def test_elements_moved_do_not_depend_on_max_model_len(operation: str) -> None:
    counts = []
    for max_model_len in (256, 32768):
        batch = make_batch(max_model_len, LENGTHS)
        if operation == "swap":
            for a, b in [(0, 3), (1, 5), (2, 4)]:
                batch.swap_states(a, b)
        else:
            batch.remove_request("r0")
            batch.remove_request("r2")
            batch.condense()
        counts.append(batch.num_elements_moved)
    assert counts[0] == counts[1] > 0
    assert counts[0] < 2 * sum(LENGTHS) + 100


def test_the_batch_counts_its_rows_that_ask_for_prompt_logprobs() -> None:
    batch = make_batch(64, [])
    asking = [NewRequestData(f"p{i}", np.arange(5, dtype=np.int32), 5, SamplingParams(prompt_logprobs=i), [1], 0)
              for i in range(2)]
    for new in (new_request(0, 10), *asking, new_request(3, 10)):
        batch.add_request(new)
    assert batch.num_prompt_logprob_rows == 2
    batch.remove_request("p0")
    batch.remove_request("r0")
    batch.condense()
    assert batch.num_prompt_logprob_rows == 1
    batch.remove_request("p1")
    assert batch.num_prompt_logprob_rows == 0


def test_a_request_keeps_its_state_slot_while_its_row_moves() -> None:
    """A linear-attention model's per-request state (gated_delta_rule.RecurrentStates) is read
    through the slot the request's row holds: kept through row moves, freed with the request."""
    batch = InputBatch(max_num_reqs=4, max_model_len=128, max_num_blocks_per_req=8)
    for i in range(4):
        batch.add_request(new_request(i, 10))
    slot_of = {req_id: int(batch.state_slots[row]) for req_id, row in batch.req_id_to_index.items()}
    assert sorted(slot_of.values()) == [0, 1, 2, 3]
    batch.remove_request("r1")
    batch.remove_request("r0")
    batch.condense()  # r3 moves down into a freed row
    assert {req_id: int(batch.state_slots[row]) for req_id, row in batch.req_id_to_index.items()} == {
        "r2": slot_of["r2"], "r3": slot_of["r3"]}
    batch.add_request(new_request(5, 10))  # the lowest free slot
    assert int(batch.state_slots[batch.req_id_to_index["r5"]]) == 0
    assert len(set(batch.state_slots[:batch.num_reqs].tolist())) == batch.num_reqs == 3
    batch.swap_states(0, 1)
    assert all(int(batch.state_slots[batch.req_id_to_index[r]]) == s for r, s in (("r2", 2), ("r3", 3)))
