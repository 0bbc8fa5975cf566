"""The process of one tensor-parallel rank, and the launcher of a node's ranks.

A rank joins the process group through the engine core's store, loads its shard of the model,
subscribes to the step broadcast, and from then on runs every message it receives:

    InitKVCache -> allocate this rank's KV cache      (rank 0 replies when done)
    StepDiff    -> ModelRunner.execute_model           (rank 0 replies with the output)
    Shutdown    -> leave the process group and exit

Every rank samples from the same all-gathered logits with the same seeds, so all ranks append the
same tokens to their persistent batches; only rank 0's output goes back. A rank exits when its
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from vllm_lite.config import EngineArgs, VllmConfig
from vllm_lite.cpu_info import openmp_child_env
from vllm_lite.distributed.parallel_state import init_tensor_parallel_group
from vllm_lite.executor.messages import InitKVCache, MessageCodec, Shutdown, WorkerReply
from vllm_lite.executor.rendezvous import join_store, read_config, read_endpoints, wait_for_store
from vllm_lite.worker.worker import Worker

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
    _start_watchdog(_wait_for_parent_death, stopping, grace=0.0)
    config = args.vllm_config
    parallel = config.parallel_config
    _limit_threads(parallel.ranks_per_node)
    store = join_store(parallel.master_addr, args.master_port)
    if config.device_config.device == "cuda":
        torch.cuda.set_device(args.local_rank)
    tp = init_tensor_parallel_group(store, args.rank, parallel.world_size, config.device_config.device)
    endpoints = read_endpoints(store)
    worker = Worker(config, tp, args.local_rank)
    proc = WorkerProc(worker, endpoints.steps, endpoints.replies if args.rank == 0 else None, stopping)
    proc.serve()
    _exit_within(DISCONNECT_GRACE_S)  # a teardown stuck on a peer that is already gone must not
    dist.destroy_process_group()      # keep this rank alive
    _exit_now()  # skips the interpreter's teardown of torch (~1 s): the engine core waits on it


class WorkerProc:
    def __init__(self, worker: Worker, steps_addr: str, replies_addr: str | None,
                 stopping: threading.Event) -> None:
        self.worker = worker
        self.codec = MessageCodec()
        self.stopping = stopping
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.steps = self.ctx.socket(zmq.SUB)
        monitor = self.steps.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # The engine core closes the broadcast right after Shutdown: a rank still busy may see
        # the drop before it reads the Shutdown queued for it, hence the grace.
        _start_watchdog(monitor.recv_multipart, stopping, grace=DISCONNECT_GRACE_S)
        self.steps.setsockopt(zmq.SUBSCRIBE, b"")
        self.steps.connect(steps_addr)  # the engine core counts subscriptions as "ready"
        self.replies = None
        if replies_addr is not None:
            self.replies = self.ctx.socket(zmq.PUSH)
            self.replies.connect(replies_addr)

    def serve(self) -> None:
        while True:
            message = self.codec.to_worker.decode(self.steps.recv(copy=False).buffer)
            if isinstance(message, Shutdown):
                self.stopping.set()
                return
            reply = self._handle(message)
            if self.replies is not None:
                self.replies.send(self.codec.encode(reply))

    def _handle(self, message: object) -> WorkerReply:
        if isinstance(message, InitKVCache):
            self.worker.initialize_kv_cache(message.num_blocks)
            return WorkerReply()
        return WorkerReply(self.worker.execute_model(message.to_scheduler_output()))


def _limit_threads(ranks_per_node: int) -> None:
    """Share this host's cores between its ranks, unless OMP_NUM_THREADS says otherwise."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_per_node))


def _start_watchdog(wait: Callable[[], object], stopping: threading.Event, grace: float) -> None:
    """When `wait()` returns, exit, unless the engine core says Shutdown within `grace` seconds
    (then the main thread is on its way out). Two watch a rank: its parent's death (from the
    start) and the broadcast connection dropping (ranks on other nodes: the engine core left)."""

    def watch() -> None:
        wait()
        if not stopping.wait(grace):
            os._exit(1)

    threading.Thread(target=watch, daemon=True, name="vllm_lite-worker-watchdog").start()


def _exit_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_within(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, args=(0,))
    timer.daemon = True
    timer.start()


def _wait_for_parent_death() -> None:
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])  # spawned: has one


# ---- starting and stopping a node's ranks ----

def start_worker_processes(vllm_config: VllmConfig, master_port: int, procs: list[BaseProcess]) -> None:
    """Spawn this node's ranks into `procs` (filled as they start, so a caller can stop them)."""
    parallel = vllm_config.parallel_config
    if vllm_config.device_config.device == "cuda" and torch.cuda.device_count() < parallel.ranks_per_node:
        raise ValueError(f"{parallel.ranks_per_node} ranks on this node need as many GPUs; "
                         f"found {torch.cuda.device_count()}")
    ctx = multiprocessing.get_context("spawn")
    for local_rank in range(parallel.ranks_per_node):
        rank = parallel.node_rank * parallel.ranks_per_node + local_rank
        args = WorkerProcArgs(vllm_config, master_port, rank, local_rank)
        proc = ctx.Process(target=run_worker, args=(args,), name=f"vllm_lite-rank{rank}", daemon=True)
        with openmp_child_env():
            proc.start()
        procs.append(proc)


def stop_processes(procs: list[BaseProcess], timeout: float) -> None:
    """Join within `timeout`, then SIGTERM, then SIGKILL whatever still runs."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


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
        stop_processes(procs, timeout=5.0)


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
