"""The process of one tensor-parallel rank, and the launcher of a node's ranks.

A rank joins the process group through the engine core's store, loads its shard of the model,
subscribes to the step broadcast, and from then on runs every message it receives:

    MeasureMemory -> the profile step; this rank's      (every rank replies with its budget)
                   KV cache budget (gpu_memory_utilization)
    InitKVCache -> allocate this rank's KV cache      (every rank replies when done)
    StepDiff    -> launch the step and finish it, or   (rank 0 replies with the output, the
                   the one launched before it           others with the requests failed on them)
    Flush       -> finish the step launched ahead      (replies as for the step)
    Profile     -> start or stop this rank's profiler  (every rank replies, with its error if any)
    CollectiveRpc -> run the call on this rank's worker (every rank replies with its result or error)
    Shutdown    -> leave the process group and exit

Every rank samples from the same all-gathered logits with the same seeds, so all ranks append the
same tokens to their persistent batches; only rank 0's output goes back. A rank whose handling of
a message raises replies with the error, its rank named, and exits: the engine core learns which
rank failed and why, not only that a process died. A rank exits when its
parent dies (at once) or the broadcast connection drops without a Shutdown (after a grace):
the engine core went away, so nothing is left running.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from vllm_lite.config import EngineArgs, VllmConfig
from vllm_lite.cpu_info import bind_model_threads, model_threads
from vllm_lite.distributed.parallel_state import init_tensor_parallel_group
from vllm_lite.exceptions import describe_error
from vllm_lite.executor.messages import MessageCodec
from vllm_lite.executor.rendezvous import join_store, read_config, read_endpoints, wait_for_store
from vllm_lite.executor.step_order import StepPipeline
from vllm_lite.lifecycle import on_parent_death, spawn, stop_processes
from vllm_lite.rpc import decode_call, encode, run_call
from vllm_lite.wire import (CollectiveRpc, Flush, InitKVCache, MeasureMemory, ModelRunnerOutput, Profile, Shutdown,
                            WorkerReply)
from vllm_lite.worker.worker import Worker, worker_class

logger = logging.getLogger(__name__)

DISCONNECT_GRACE_S = 5.0


@dataclass(frozen=True, slots=True)
class WorkerProcArgs:
    vllm_config: VllmConfig
    master_port: int  # the store's actual port (master_port may be None in the config)
    rank: int
    local_rank: int


def run_worker(args: WorkerProcArgs) -> None:
    """Process entry of one rank."""
    stopping = threading.Event()  # set on Shutdown: the watchdogs stand down
    on_parent_death(lambda: stopping.is_set() or os._exit(1), name="vllm_lite-worker-parent-watch")
    config = args.vllm_config
    parallel = config.parallel_config
    on_cpu = config.device_config.device == "cpu"  # (VLLM_CPU_OMP_THREADS_BIND binds CPU ranks only)
    torch.set_num_threads(bind_model_threads(parallel.first_local_process + args.local_rank,
                                             parallel.model_processes_per_node) if on_cpu
                          else model_threads(parallel.model_processes_per_node))
    store = join_store(parallel.master_addr, args.master_port)
    if config.device_config.device == "cuda":
        torch.cuda.set_device(parallel.first_local_process + args.local_rank)
    tp = init_tensor_parallel_group(store, args.rank, parallel.world_size, config.device_config.device)
    endpoints = read_endpoints(store)
    worker = worker_class(config)(config, tp, args.local_rank)
    proc = WorkerProc(worker, endpoints.steps, endpoints.replies, stopping, args.rank)
    proc.serve()
    _exit_within(DISCONNECT_GRACE_S)  # a teardown stuck on a peer that is already gone must not
    dist.destroy_process_group()      # keep this rank alive
    _exit_now()  # skips the interpreter's teardown of torch (~1 s): the engine core waits on it


class WorkerProc:
    def __init__(self, worker: Worker, steps_addr: str, replies_addr: str,
                 stopping: threading.Event, rank: int = 0) -> None:
        self.worker = worker
        self.rank = rank
        self.codec = MessageCodec()
        self.stopping = stopping
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.steps = self.ctx.socket(zmq.SUB)
        # The engine core closes the broadcast right after Shutdown: a rank still busy may see
        # the drop before it reads the Shutdown queued for it, hence the grace.
        self.watchdog = DisconnectWatchdog(self.steps.get_monitor_socket(zmq.EVENT_DISCONNECTED), stopping,
                                           grace=DISCONNECT_GRACE_S)
        self.steps.setsockopt(zmq.SUBSCRIBE, b"")
        self.steps.connect(steps_addr)  # the engine core counts subscriptions as "ready"
        self.replies = self.ctx.socket(zmq.PUSH)
        self.replies.connect(replies_addr)
        self.pipeline: StepPipeline | None = None  # from InitKVCache on

    def serve(self) -> None:
        with self.worker.step_thread_mode():
            while True:
                message = self.codec.decode_to_worker(self.steps.recv_multipart(copy=False))
                if isinstance(message, Shutdown):
                    if self.pipeline is not None:
                        self.pipeline.stop()
                    self.worker.stop_profiling()
                    self.stopping.set()
                    return
                self._answer(message)

    def _answer(self, message: object) -> None:
        try:
            results = self._handle(message)
        except Exception as exc:
            results = [exc]
        for result in results:
            if isinstance(result, BaseException):
                logger.error("rank %d failed", self.rank, exc_info=result)
                self._send_error(f"rank {self.rank}: {describe_error(result)}")
                raise result
            self.replies.send_multipart(self.codec.encode_reply(result), copy=False)

    def _handle(self, message: object) -> list[WorkerReply | BaseException]:
        """A reply (or the exception) for each step finished now, in step order: a step launched
        ahead is answered after the next step's launch, or at a Flush."""
        if isinstance(message, MeasureMemory):
            return [WorkerReply(rank=self.rank, kv_cache_budget=self.worker.determine_available_memory())]
        if isinstance(message, Profile):
            return [self._profile(message)]
        if isinstance(message, CollectiveRpc):
            return [self._collective_rpc(message)]
        if isinstance(message, InitKVCache):
            self.worker.initialize_kv_cache(message.num_blocks, message.num_state_slots)
            self.pipeline = StepPipeline(self.worker, message.launch_ahead)
            return [WorkerReply(rank=self.rank)]
        assert self.pipeline is not None, "a step before InitKVCache"
        results = (self.pipeline.flush() if isinstance(message, Flush)
                   else self.pipeline.run(message.to_scheduler_output()))
        return [result if isinstance(result, BaseException) else self._reply(result) for result in results]

    def _profile(self, message: Profile) -> WorkerReply:
        """A profiler that cannot start or write is this call's failure, not the rank's."""
        try:
            self.worker.profile(message.is_start, message.profile_prefix, message.delay_iterations,
                                message.max_iterations)
        except Exception as exc:
            logger.warning("rank %d: profile(is_start=%s) failed", self.rank, message.is_start, exc_info=exc)
            return WorkerReply(rank=self.rank, profile_error=f"rank {self.rank}: {describe_error(exc)}")
        return WorkerReply(rank=self.rank)

    def _collective_rpc(self, message: CollectiveRpc) -> WorkerReply:
        """A call that fails (or whose result cannot be encoded) is the call's failure, not the rank's."""
        try:
            return WorkerReply(rank=self.rank, rpc_result=encode(run_call(self.worker, decode_call(message.call))))
        except Exception as exc:
            logger.warning("rank %d: collective_rpc failed", self.rank, exc_info=exc)
            return WorkerReply(rank=self.rank, rpc_error=f"rank {self.rank}: {describe_error(exc)}")

    def _reply(self, output: ModelRunnerOutput) -> WorkerReply:
        if self.rank == 0:
            return WorkerReply(output)
        return WorkerReply(rank=self.rank, failed=output.failed)

    def _send_error(self, error: str) -> None:
        """The last message of this rank: sent before the process exits. The context is
        destroyed with a linger (its default is 0), which waits for the message to leave: the
        process ends by os._exit, where a socket closed alone could drop it unsent."""
        self.replies.send_multipart(self.codec.encode_reply(WorkerReply(rank=self.rank, error=error)))
        self.watchdog.close()  # (destroy closes every socket of the context: not one another thread is in)
        self.ctx.destroy(linger=int(DISCONNECT_GRACE_S * 1000))


class DisconnectWatchdog:
    """Exits the process when the broadcast connection drops (`monitor`: the step socket's
    EVENT_DISCONNECTED monitor; ranks on other nodes: the engine core left), unless the engine
    core says Shutdown within `grace` seconds (`stopping`: the main thread is on its way out). A
    rank's parent dying ends it at once (`on_parent_death`). Only the watchdog's thread touches
    `monitor`, and closes it on `close()`: a ZMQ socket closed while another thread waits on it
    aborts the process (libzmq's "pfd.revents & POLLIN" assertion), which lost a failing rank's
    last message once."""

    POLL_MS = 100  # how soon `close()` is seen

    def __init__(self, monitor: zmq.Socket, stopping: threading.Event, grace: float) -> None:
        self._monitor, self._stopping, self._grace = monitor, stopping, grace
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="vllm_lite-worker-watchdog")
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop watching; returns once the monitor socket is closed (or after `timeout_s`)."""
        self._closing.set()
        self._thread.join(timeout_s)

    def _watch(self) -> None:
        try:
            while not self._closing.is_set():
                if self._monitor.poll(self.POLL_MS):
                    self._monitor.recv_multipart()
                    if not self._stopping.wait(self._grace):
                        os._exit(1)
                    return
        finally:
            self._monitor.close(linger=0)


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_within(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


# ---- starting and stopping a node's ranks ----

def start_worker_processes(vllm_config: VllmConfig, master_port: int, procs: list[BaseProcess]) -> None:
    """Spawn this node's ranks into `procs` (filled as they start, so a caller can stop them)."""
    parallel = vllm_config.parallel_config
    if vllm_config.device_config.device == "cuda" and torch.cuda.device_count() < parallel.model_processes_per_node:
        raise ValueError(f"{parallel.model_processes_per_node} ranks on this node (data-parallel engines' included) "
                         f"need as many GPUs; found {torch.cuda.device_count()}")
    for local_rank in range(parallel.ranks_per_node):
        rank = parallel.node_rank * parallel.ranks_per_node + local_rank
        args = WorkerProcArgs(vllm_config, master_port, rank, local_rank)
        procs.append(spawn(run_worker, (args,), name=f"vllm_lite-rank{rank}", daemon=True, imports_torch=True))


def run_worker_node(engine_args: EngineArgs) -> int:
    """`vllm-lite worker`: run node `node_rank`'s ranks of an engine whose core runs on node 0,
    until that engine shuts down. Node 0's configuration is used; `model`, when given, is this
    node's copy of the weights."""
    if not 1 <= engine_args.node_rank < engine_args.nnodes:
        raise ValueError(f"node_rank must be in [1, nnodes={engine_args.nnodes}) for `worker` "
                         f"(node 0 runs the engine core), got {engine_args.node_rank}")
    if engine_args.master_port is None:
        raise ValueError("master_port must be set: the port of node 0's rendezvous")
    wait_for_store(engine_args.master_addr, engine_args.master_port)
    config = _node_config(engine_args, read_config(join_store(engine_args.master_addr, engine_args.master_port)))
    procs: list[BaseProcess] = []
    try:
        start_worker_processes(config, engine_args.master_port, procs)
        return _wait_for_workers(procs)
    finally:
        stop_processes(procs, grace_s=5.0)


def _node_config(engine_args: EngineArgs, published: VllmConfig) -> VllmConfig:
    parallel = published.parallel_config
    for name in ("tensor_parallel_size", "nnodes"):
        mine, theirs = getattr(engine_args, name), getattr(parallel, name)
        if mine != theirs:
            raise ValueError(f"{name}={mine} differs from node 0's {name}={theirs}")
    model_config = published.model_config
    if engine_args.model is not None:
        if not Path(engine_args.model).is_dir():
            raise ValueError(f"model: folder '{engine_args.model}' does not exist")
        model_config = dataclasses.replace(model_config, model=engine_args.model)
    return dataclasses.replace(published, model_config=model_config,
                               parallel_config=dataclasses.replace(parallel, node_rank=engine_args.node_rank))


def _wait_for_workers(procs: list[BaseProcess]) -> int:
    """0 when every rank exits cleanly; 1 as soon as one fails."""
    pending = {proc.sentinel: proc for proc in procs}
    while pending:
        for sentinel in multiprocessing.connection.wait(list(pending)):
            proc = pending.pop(sentinel)
            proc.join()
            if proc.exitcode != 0:
                logger.error("worker %s exited with code %s", proc.name, proc.exitcode)
                return 1
    return 0
