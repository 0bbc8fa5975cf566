"""Messages between the engine core and its worker processes (msgspec msgpack, no pickle).

Engine core -> every rank, one message per step: `StepDiff`, the step's diff of the persistent
batch. A request's tokens travel once, in `NewRequestData` when it is scheduled for the first
time (or again after preemption); afterwards only its id, new block ids and counters do, as
fixed-width int32 arrays, so the bytes of a decode step do not depend on prompt length.

Rank 0 -> engine core: `WorkerReply` with the step's `ModelRunnerOutput`, or an error when a
worker died (posted by the executor's monitor thread into the same channel).

Numpy arrays travel as (dtype, shape, raw bytes).
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np

from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.worker.model_runner import ModelRunnerOutput


class InitKVCache(msgspec.Struct, tag=True, array_like=True, gc=False):
    num_blocks: int


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


class StepDiff(msgspec.Struct, tag=True, array_like=True, gc=False):
    """A `SchedulerOutput` in wire form. Row i of every `cached_*` array belongs to
    `cached_req_ids[i]`; its new block ids are the next `cached_num_new_blocks[i]` entries of
    `cached_new_block_ids`."""

    new_reqs: list[NewRequestData]
    new_num_scheduled: np.ndarray  # int32 [num_new]
    cached_req_ids: list[str]
    cached_num_scheduled: np.ndarray  # int32 [num_cached]
    cached_num_computed: np.ndarray  # int32 [num_cached], before this step
    cached_num_new_blocks: np.ndarray  # int32 [num_cached]
    cached_new_block_ids: np.ndarray  # int32 [sum(cached_num_new_blocks)]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    preempted_req_ids: list[str]

    @staticmethod
    def from_scheduler_output(sched: SchedulerOutput) -> StepDiff:
        cached = sched.scheduled_cached_reqs
        scheduled = sched.num_scheduled_tokens
        return StepDiff(
            new_reqs=sched.scheduled_new_reqs,
            new_num_scheduled=_int32([scheduled[new.req_id] for new in sched.scheduled_new_reqs]),
            cached_req_ids=cached.req_ids,
            cached_num_scheduled=_int32([scheduled[req_id] for req_id in cached.req_ids]),
            cached_num_computed=_int32(cached.num_computed_tokens),
            cached_num_new_blocks=_int32([len(blocks) for blocks in cached.new_block_ids]),
            cached_new_block_ids=_int32(list(itertools.chain.from_iterable(cached.new_block_ids))),
            total_num_scheduled_tokens=sched.total_num_scheduled_tokens,
            finished_req_ids=list(sched.finished_req_ids),
            preempted_req_ids=list(sched.preempted_req_ids),
        )

    def to_scheduler_output(self) -> SchedulerOutput:
        ends = np.cumsum(self.cached_num_new_blocks).tolist()
        flat = self.cached_new_block_ids.tolist()
        new_block_ids = [flat[end - n:end] for end, n in zip(ends, self.cached_num_new_blocks.tolist())]
        req_ids = self.cached_req_ids + [new.req_id for new in self.new_reqs]
        counts = self.cached_num_scheduled.tolist() + self.new_num_scheduled.tolist()
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData(self.cached_req_ids, new_block_ids,
                                                    self.cached_num_computed.tolist()),
            num_scheduled_tokens=dict(zip(req_ids, counts)),
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(self.preempted_req_ids),
        )


EngineToWorker = InitKVCache | StepDiff | Shutdown


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    output: ModelRunnerOutput | None = None
    error: str | None = None  # set when a worker died: the engine is dead


def _int32(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        array = np.ascontiguousarray(obj)
        return array.dtype.str, array.shape, memoryview(array).cast("B")
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()  # writable, like uniproc's
    raise NotImplementedError(f"cannot decode {kind}")


class MessageCodec:
    """Encoder and decoders for both directions (one per process; not shared across threads)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.to_worker = msgspec.msgpack.Decoder(EngineToWorker, dec_hook=_dec_hook)
        self.to_engine = msgspec.msgpack.Decoder(WorkerReply, dec_hook=_dec_hook)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self.encoder.encode(message)
