"""Messages between the engine core and its worker processes (msgspec msgpack, no pickle).

Engine core -> every rank, one message per step: `StepDiff`, the step's diff of the persistent
batch. A request's tokens travel once, in `NewRequestData` when it is scheduled for the first
time (or again after preemption); afterwards only its id, new block ids and counters do, as
fixed-width int32 arrays, so the bytes of a decode step do not depend on prompt length.

Rank 0 -> engine core: `WorkerReply` with the step's `ModelRunnerOutput`, or an error when a
worker died (posted by the executor's monitor thread into the same channel).

Framing: `[kind, msgpack frame, *array frames]` to the ranks, `[msgpack frame, *array frames]`
back, by the one wire codec (`vllm_lite.wire.codec`): arrays are never copied on receipt.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.wire import (CollectiveRpc, Flush, Frame, InitKVCache, MeasureMemory, MsgpackDecoder, MsgpackEncoder,
                            Profile, Shutdown, WorkerReply)


class StepDiff(msgspec.Struct, array_like=True, gc=False):
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
    structured_output_req_ids: list[str]
    grammar_bitmask: np.ndarray | None
    # speculative decoding: request id -> its draft tokens (int32); empty in most steps
    spec_decode_tokens: dict[str, np.ndarray] = {}

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
            cached_num_new_blocks=cached.num_new_blocks,
            cached_new_block_ids=cached.new_block_ids,
            total_num_scheduled_tokens=sched.total_num_scheduled_tokens,
            finished_req_ids=list(sched.finished_req_ids),
            preempted_req_ids=list(sched.preempted_req_ids),
            structured_output_req_ids=list(sched.structured_output_req_ids),
            grammar_bitmask=sched.grammar_bitmask,
            spec_decode_tokens=sched.scheduled_spec_decode_tokens,
        )

    def to_scheduler_output(self) -> SchedulerOutput:
        """The received arrays themselves (views of the message's frames), not lists."""
        req_ids = self.cached_req_ids + [new.req_id for new in self.new_reqs]
        counts = np.concatenate([self.cached_num_scheduled, self.new_num_scheduled]).tolist()
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData(self.cached_req_ids, self.cached_num_computed,
                                                    self.cached_num_new_blocks, self.cached_new_block_ids),
            num_scheduled_tokens=dict(zip(req_ids, counts)),
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(self.preempted_req_ids),
            structured_output_req_ids=tuple(self.structured_output_req_ids),
            grammar_bitmask=self.grammar_bitmask,
            scheduled_spec_decode_tokens=self.spec_decode_tokens,
        )


EngineToWorker = InitKVCache | StepDiff | Flush | Shutdown | MeasureMemory | Profile | CollectiveRpc


def _int32(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


# First frame of an engine core -> rank message (wire.codec frames follow).
_INIT_KV_CACHE, _STEP, _SHUTDOWN, _FLUSH, _MEASURE_MEMORY, _PROFILE, _RPC = (b"\x00", b"\x01", b"\x02", b"\x03",
                                                                          b"\x04", b"\x05", b"\x06")
_TO_WORKER: dict[bytes, type] = {_INIT_KV_CACHE: InitKVCache, _STEP: StepDiff, _SHUTDOWN: Shutdown,
                                 _FLUSH: Flush, _MEASURE_MEMORY: MeasureMemory, _PROFILE: Profile,
                                 _RPC: CollectiveRpc}
_KIND = {struct: kind for kind, struct in _TO_WORKER.items()}


class MessageCodec:
    """The wire codec (numpy arrays as uncopied frames) for both directions of the step channel.
    One per process; not shared across threads. Decoded arrays are read-only views."""

    def __init__(self) -> None:
        self.encoder = MsgpackEncoder()
        self._to_worker = {kind: MsgpackDecoder(struct) for kind, struct in _TO_WORKER.items()}
        self._to_engine = MsgpackDecoder(WorkerReply)

    def encode_to_worker(self, message: EngineToWorker) -> list[Frame]:
        return [_KIND[type(message)], *self.encoder.encode(message)]

    def encode_reply(self, reply: WorkerReply) -> list[Frame]:
        return self.encoder.encode(reply)

    def decode_to_worker(self, frames: Sequence[Frame]) -> EngineToWorker:
        return self._to_worker[_buffer_bytes(frames[0])].decode(frames[1:])

    def decode_reply(self, frames: Sequence[Frame]) -> WorkerReply:
        return self._to_engine.decode(frames)


def payload_bytes(frames: Sequence[Frame]) -> int:
    return sum(memoryview(getattr(frame, "buffer", frame)).nbytes for frame in frames)


def _buffer_bytes(frame: Frame) -> bytes:
    return bytes(getattr(frame, "buffer", frame))
