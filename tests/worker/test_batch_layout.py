"""The persistent batch's row layout must not depend on a set's iteration order (the hash seed
of the process): tensor-parallel ranks are separate processes that must place every request in
the same row, since their collectives combine rows by position."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from vllm_lite.config import EngineArgs
from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.model_runner import ModelRunner


class OrderedIds(frozenset):
    """A frozenset that iterates in a chosen order, as another process's hash seed might."""

    order: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)


def ids_in_order(*order: str) -> OrderedIds:
    ids = OrderedIds(order)
    ids.order = order
    return ids


def new_request(req_id: str) -> NewRequestData:
    return NewRequestData(req_id, np.arange(5, dtype=np.int32), 5, SamplingParams(), [1], 0)


def step(new: list[str], finished: frozenset[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput([new_request(r) for r in new], CachedRequestData.empty(), {r: 5 for r in new},
                           5 * len(new), finished, frozenset())


def test_rows_do_not_depend_on_the_order_finished_ids_iterate_in(tiny_llama: Path) -> None:
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, max_num_seqs=8).create_engine_config()
    layouts = []
    for order in (("a", "c"), ("c", "a")):
        runner = ModelRunner(config, torch.device("cpu"))
        runner._update_states(step(["a", "b", "c", "d"]))
        runner._update_states(step(["e", "f"], ids_in_order(*order)))
        layouts.append(list(runner.input_batch.live_req_ids))
    assert layouts[0] == layouts[1]
