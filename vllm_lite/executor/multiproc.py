"""MultiprocExecutor: one worker process per tensor-parallel rank.

```
 engine core (this process)                          rank processes (spawned; other nodes: `vllm-lite worker`)
 ┌─────────────────────────────┐  XPUB ── StepDiff ──▶ SUB   every rank (ipc:// in a private 0700 dir;
 │ MultiprocExecutor           │                             tcp:// on master_addr with nnodes > 1)
 │                             │  PULL ◀─ WorkerReply ─ PUSH  every rank: rank 0's carries the output
 │ TCPStore (rendezvous)       │ ◀──── init_process_group ──── every rank; gloo (CPU) / NCCL (CUDA)
 │ monitor thread              │  watches the rank processes; a death becomes an error reply
 └─────────────────────────────┘
```

One message per step, serialized once and fanned out by ZMQ. Ranks run in lockstep (their
collectives synchronize them). With async scheduling the engine core broadcasts step N+1 while
the ranks run step N (it waits in their sockets), then reads step N's replies: each rank
replies in step order, so at most two steps are in flight. On GPUs the ranks launch step N+1
before they finish step N (`executor.step_order`, the order the engine core names in
`InitKVCache`): a take with no step submitted after the held one broadcasts a `Flush`. Ready
means subscribed: the XPUB socket sees one subscription per rank once its model shard is loaded.

Sampling: the LM head all-gathers the logits, so every rank samples the same tokens from the same
logits with the same seeds and keeps its persistent batch in step; only rank 0's reply carries
the output, the others' the requests that failed on them.

Failure: every rank replies once to every step, and the executor waits for all of them. A request
that fails on any rank fails alone (the ranks agree before the forward pass on the requests that
could not join; one whose sampling failed on a rank is reported by that rank, which appends a
filler token to its row so that its batch keeps the other ranks' layout in a step already
queued; the engine core frees the request when the output arrives, and discards what a step in
flight still returns for it). A rank whose step raises replies with the error, its rank
named, and exits: the step raises `EngineDeadError` with that error. A `lifecycle.DeathWatch`
waits on the rank processes' sentinels; when one dies it posts an error reply into the reply
channel, so a waiting step wakes and raises (within milliseconds; up to RANK_ERROR_GRACE_S more
while the dead rank's own error, which names the cause, may still be on its way), as does every
later call.
Ranks on other nodes are not watched from here: their death surfaces on node 0 when rank 0's
next collective fails.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import socket
import tempfile
import time
import weakref
from collections import deque
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from vllm_lite.config import ParallelConfig, VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.exceptions import EngineDeadError
from vllm_lite.executor.abstract import Executor
from vllm_lite.executor.messages import MessageCodec, StepDiff, payload_bytes
from vllm_lite.executor.rendezvous import Endpoints, host_store, publish
from vllm_lite.executor.step_order import HeldSteps, launches_ahead
from vllm_lite.executor.worker_proc import start_worker_processes
from vllm_lite.lifecycle import DeathWatch, ProcessResources, describe_exit
from vllm_lite.rpc import RpcCall, decode, encode_call
from vllm_lite.wire import (CollectiveRpc, Flush, InitKVCache, MeasureMemory, ModelRunnerOutput, Profile, Shutdown,
                            WorkerReply)

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0  # model loading on every rank, other nodes included
SHUTDOWN_TIMEOUT_S = 5.0
PEER_DEATH_GRACE_S = 1.0  # after a rank's error: how long to wait for another rank's exit to show
RANK_ERROR_GRACE_S = 1.0  # after a first error: how long to wait for the ranks' own errors


class MultiprocExecutor(Executor):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.node_rank != 0:
            raise ValueError(f"node_rank={parallel.node_rank}: the engine core runs on node 0; "
                             "other nodes run only their ranks (`vllm-lite worker`)")
        self.world_size = parallel.world_size
        self.held_steps = HeldSteps(self.launches_ahead(vllm_config.device_config.device))
        self.codec = MessageCodec()
        self.bytes_broadcast = 0  # payload bytes sent to the ranks so far (all messages)
        self._dead_reason: str | None = None
        # Replies that came before another rank's reply to an earlier step (see _receive_replies).
        self._replies_ahead: list[deque[WorkerReply]] = [deque() for _ in range(self.world_size)]
        # mkdtemp makes the directory 0700: the ipc sockets in it are private to this user.
        self._tmp_dir = tempfile.mkdtemp(prefix="vllm_lite_")
        self._res = ProcessResources(zmq.Context(), private_dirs=[self._tmp_dir])
        self._res.ctx.setsockopt(zmq.LINGER, 0)
        self._finalizer = weakref.finalize(self, self._res.release, 0.0)
        try:
            self._start(parallel)
        except BaseException:
            self.shutdown()
            raise

    @property
    def procs(self) -> list[BaseProcess]:
        return self._res.procs

    # ---- start-up ----
    def _start(self, parallel: ParallelConfig) -> None:
        ctx = self._res.ctx
        self._steps, steps_addr = self._bind_steps(ctx, parallel)
        self._replies = ctx.socket(zmq.PULL)
        replies_addr = self._bind(self._replies, "replies", parallel)
        self._store = host_store(parallel)
        publish(self._store, self.vllm_config, Endpoints(steps_addr, replies_addr))
        start_worker_processes(self.vllm_config, self._store.port, self._res.procs)
        notify = _DeathNotice(self._res.ctx, replies_addr)
        self._res.watch = DeathWatch(self._res.procs, notify, name="vllm_lite-executor-monitor")
        self._wait_until_ready()

    def _bind_steps(self, ctx: zmq.Context, parallel: ParallelConfig) -> tuple[zmq.Socket, str]:
        steps = ctx.socket(zmq.XPUB)
        steps.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank, not per topic
        steps.setsockopt(zmq.XPUB_NODROP, 1)  # block rather than drop a step
        return steps, self._bind(steps, "steps", parallel)

    def _bind(self, sock: zmq.Socket, name: str, parallel: ParallelConfig) -> str:
        """ipc:// in the private directory on one node; tcp:// on master_addr across nodes."""
        if parallel.nnodes == 1:
            address = f"ipc://{self._tmp_dir}/{name}"
            sock.bind(address)
            return address
        host = socket.gethostbyname(parallel.master_addr)
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    def _wait_until_ready(self) -> None:
        """Until every rank subscribed to the step broadcast (its model is loaded)."""
        poller = zmq.Poller()
        poller.register(self._steps, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        subscribed = 0
        while subscribed < self.world_size:
            events = dict(poller.poll(max(0.0, (deadline - time.monotonic()) * 1000)))
            if not events:
                raise TimeoutError(f"{subscribed} of {self.world_size} ranks joined within "
                                   f"{WORKER_START_TIMEOUT_S:.0f} s; with nnodes > 1, is `vllm-lite "
                                   "worker` running on every other node?")
            if self._replies in events:
                self._receive_reply()  # before any step, only a death notice comes here: raises
            if self._steps in events and self._steps.recv()[:1] == b"\x01":
                subscribed += 1

    # ---- the executor interface ----
    @staticmethod
    def launches_ahead(device_type: str) -> bool:
        """Whether the ranks launch a step before finishing the one before it
        (`step_order.launches_ahead`)."""
        return launches_ahead(device_type)

    def determine_available_memory(self) -> int:
        """The smallest rank's KV cache budget: every rank holds the same number of blocks."""
        self._broadcast(MeasureMemory())
        return min(reply.kv_cache_budget for reply in self._receive_replies())

    def initialize_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self._broadcast(InitKVCache(num_blocks, self.held_steps.launch_ahead, num_state_slots))
        self._receive_replies()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_model(scheduler_output)
        return self.take_model_output()

    def submit_model(self, scheduler_output: SchedulerOutput) -> None:
        """The ranks queue the step behind the one they run (the broadcast socket buffers it)."""
        self._broadcast(StepDiff.from_scheduler_output(scheduler_output))
        self.held_steps.submitted()

    def take_model_output(self) -> ModelRunnerOutput:
        """The oldest submitted step's output: rank 0's, with the requests that failed on the
        other ranks merged into `failed`."""
        if self.held_steps.take_needs_flush():
            self._broadcast(Flush())
        replies = self._receive_replies()
        self.held_steps.taken()
        output = replies[0].output
        for reply in replies[1:]:
            if reply.failed:  # this rank's own failures (agreed ones are in rank 0's already)
                output.failed = {**reply.failed, **(output.failed or {})}
        return output

    def profile(self, is_start: bool, profile_prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        assert not self.held_steps.num_pending, "a submitted step is not taken"
        self._broadcast(Profile(is_start, profile_prefix, delay_iterations, max_iterations))
        errors = [reply.profile_error for reply in self._receive_replies() if reply.profile_error]
        if errors:
            raise RuntimeError("; ".join(errors))

    def collective_rpc(self, call: RpcCall) -> list[Any]:
        assert not self.held_steps.num_pending, "a submitted step is not taken"
        self._broadcast(CollectiveRpc(encode_call(call)))
        replies = self._receive_replies()
        errors = [reply.rpc_error for reply in replies if reply.rpc_error]
        if errors:
            raise RuntimeError("collective_rpc failed: " + "; ".join(errors))
        return [decode(reply.rpc_result) for reply in replies]

    def shutdown(self) -> None:
        """Ask the ranks to exit and make sure they did (SIGTERM, then SIGKILL); idempotent."""
        if not self._finalizer.alive:
            return
        grace = 0.0
        if self._dead_reason is None and self._res.procs:
            try:
                self._steps.send_multipart(self.codec.encode_to_worker(Shutdown()), zmq.NOBLOCK)
                grace = SHUTDOWN_TIMEOUT_S
            except zmq.ZMQError:
                pass
        self._dead_reason = self._dead_reason or "the executor was shut down"
        self._finalizer.detach()
        self._res.release(grace)
        self._store = None  # stops the rendezvous server

    # ---- channels ----
    def _broadcast(self, message: msgspec.Struct) -> None:
        self._check_alive()
        frames = self.codec.encode_to_worker(message)
        self.bytes_broadcast += payload_bytes(frames)
        self._steps.send_multipart(frames, copy=False)

    def _receive_replies(self) -> list[WorkerReply]:
        """One reply from every rank to the oldest message not answered yet, by rank; the first
        error (a rank that failed or died) raises at once, without waiting for ranks that may be
        stuck in a collective. Each rank replies in message order, but with two steps in flight
        a rank's reply to the next step may come before another rank's reply to this one: it
        is kept for the next call."""
        replies: list[WorkerReply | None] = [None] * self.world_size
        for rank, ahead in enumerate(self._replies_ahead):
            if ahead:
                replies[rank] = ahead.popleft()
        missing = replies.count(None)
        while missing:
            reply = self._receive_reply()
            if replies[reply.rank] is None:
                replies[reply.rank] = reply
                missing -= 1
            else:
                self._replies_ahead[reply.rank].append(reply)
        return replies  # type: ignore[return-value]

    def _receive_reply(self) -> WorkerReply:
        reply = self.codec.decode_reply(self._replies.recv_multipart(copy=False))
        if reply.error is not None:
            errors = self._rank_errors_after(reply)
            self._dead_reason = self._with_dead_ranks("; ".join(errors) if errors else reply.error)
            self._check_alive()
        return reply

    def _rank_errors_after(self, first: WorkerReply) -> list[str]:
        """The ranks' own errors, the first one's and those arriving within RANK_ERROR_GRACE_S
        after it. A rank that fails sends its error, then exits; the death watch's notice of that
        exit, or another rank's error from a collective the dead rank left (the symptom), may
        still arrive first (the rank's message leaves through its own socket's I/O thread as the
        process ends). Replies without an error are dropped: the engine is dead either way."""
        errors = [] if first.death_notice else [first.error]
        deadline = time.monotonic() + RANK_ERROR_GRACE_S
        while (left := deadline - time.monotonic()) > 0 and self._replies.poll(int(left * 1000) + 1):
            reply = self.codec.decode_reply(self._replies.recv_multipart(copy=False))
            if reply.error is not None and not reply.death_notice and reply.error not in errors:
                errors.append(reply.error)
        return errors

    def _with_dead_ranks(self, error: str) -> str:
        """A rank's error, preceded by the ranks that have exited: when a rank dies mid-step, the
        others' collectives fail too, and their error (a reset connection) may arrive before the
        death watch's notice. Waits up to PEER_DEATH_GRACE_S for an exit, so the reason names
        the rank that died, the cause, not only the symptom."""
        procs = self._res.procs
        ready = multiprocessing.connection.wait([proc.sentinel for proc in procs], timeout=PEER_DEATH_GRACE_S)
        for proc in procs:
            if proc.sentinel in ready:  # its sentinel closes as it exits, a moment before its status is there
                proc.join(PEER_DEATH_GRACE_S)
        dead = [proc for proc in procs if proc.exitcode is not None and proc.name not in error]
        return f"{describe_exit(dead)}; then {error}" if dead else error

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine's workers are gone: {self._dead_reason}")


class _DeathNotice:
    """Called on the death watch's thread: turns a rank's death into an error reply, so a step
    waiting for rank 0 wakes up and raises."""

    def __init__(self, ctx: zmq.Context, replies_addr: str) -> None:
        self.ctx = ctx
        self.replies_addr = replies_addr

    def __call__(self, dead: list[BaseProcess]) -> None:
        reason = describe_exit(dead)
        logger.error("tensor-parallel worker died: %s", reason)
        notice = self.ctx.socket(zmq.PUSH)
        notice.connect(self.replies_addr)
        notice.send(msgspec.msgpack.encode(WorkerReply(error=reason, death_notice=True)))
        notice.close(linger=1000)
