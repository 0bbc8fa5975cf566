"""Faults injected into one rank of a tensor-parallel engine, for tests only.

A test sets `RANK_FAULT_ENV` to "<rank>:<fault>" and replaces `worker_proc.run_worker` with
`run_worker_with_fault`; each spawned rank imports this module (spawn hands the parent's
sys.path to its children) and, on the named rank only, patches its model runner before running
as usual. Every fault fires for the request id "poison" only."""

from __future__ import annotations

import os
from collections.abc import Callable

from vllm_lite.executor.worker_proc import WorkerProcArgs, run_worker
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.model_runner import ModelRunner

RANK_FAULT_ENV = "VLLM_LITE_TEST_RANK_FAULT"
POISON = "poison"


def _fail_joining_the_batch() -> None:
    add_request = InputBatch.add_request

    def faulty(self, new):
        if new.req_id == POISON:
            raise RuntimeError("injected fault")
        return add_request(self, new)

    InputBatch.add_request = faulty


def _fail_building_sampling_metadata() -> None:
    build = ModelRunner._build_sampling_metadata

    def faulty(self, rows, vocab_size):
        if POISON in [self.input_batch.req_ids[row] for row in rows.tolist()]:
            raise RuntimeError("injected fault")
        return build(self, rows, vocab_size)

    ModelRunner._build_sampling_metadata = faulty


def _fail_the_step() -> None:
    launch = ModelRunner.launch

    def faulty(self, scheduler_output):
        if any(new.req_id == POISON for new in scheduler_output.scheduled_new_reqs):
            raise RuntimeError("injected fault")
        return launch(self, scheduler_output)

    ModelRunner.launch = faulty


FAULTS: dict[str, Callable[[], None]] = {
    "join": _fail_joining_the_batch,
    "sampling": _fail_building_sampling_metadata,
    "step": _fail_the_step,
}


def run_worker_with_fault(args: WorkerProcArgs) -> None:
    rank, fault = os.environ[RANK_FAULT_ENV].split(":")
    if int(rank) == args.rank:
        FAULTS[fault]()
    run_worker(args)
