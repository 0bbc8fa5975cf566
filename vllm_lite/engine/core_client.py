"""Clients of the engine core.

| client | engine core | used by |
|---|---|---|
| InprocClient | in this process, stepped by the caller | `LLM(..., multiprocess=False)`, tests |
| SyncMPClient | own process (spawned) or attached at an address | `LLM` |
| AsyncMPClient | own process (spawned) or attached at an address | `AsyncLLM` |

A multi-process client talks to the engine core over one DEALER socket (engine side: a
ROUTER). It notices a dead engine within `_POLL_S` when it spawned the process (a thread waits
on the process sentinel) and after `heartbeat_timeout_s` of silence when it attached (it sends
`is_healthy` calls while it hears nothing). From then on every pending and every new call
raises EngineDeadError.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vllm_lite.config import VllmConfig
from vllm_lite.cpu_info import THREADS_BIND_ENV, bound_cpu_lists
from vllm_lite.engine.core import EngineCore
from vllm_lite.exceptions import EngineDeadError, RequestRejectedError
from vllm_lite.engine.launch import EngineLaunch, fetch_engine_info, launch_engine_core, utility_value
from vllm_lite.rpc import RpcCall, decode, encode_call
from vllm_lite.wire import (
    OUTPUT_STRUCTS,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    MsgpackDecoder,
    MsgpackEncoder,
    OutputType,
    RequestError,
    RequestIdsReceiver,
    RequestType,
    UtilityRequest,
    UtilityResult,
)
from vllm_lite.engine.zmq_utils import make_socket, normalize_address
from vllm_lite.lifecycle import DeathWatch, ProcessResources

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a waiting sync client re-checks that the engine lives
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0


class InprocClient(EngineCore):
    """The engine core itself, stepped by the caller: the client calls (add_request,
    abort_requests, get_stats, reset_prefix_cache, shutdown) are EngineCore's own."""

    def get_output(self) -> EngineCoreOutputs:
        """A request a step failed on raises (as a multi-process client's rejection does) on
        the call after that step."""
        if self.failed_requests:
            error = self.failed_requests.pop(0)
            raise RequestRejectedError(error.request_id, error.message, error.while_running)
        return self.step()

    def collective_rpc(self, call: RpcCall, timeout_s: float | None = None) -> list[Any]:
        """In this process the call runs in the caller's thread (nothing is serialized, so any
        function may be given), where it cannot be abandoned: a timeout is refused."""
        if timeout_s is not None:
            raise ValueError("collective_rpc: timeout needs the engine core in its own process (multiprocess=True); "
                             "in this process a call runs in the caller's thread and cannot be abandoned")
        return super().collective_rpc(call)

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        _refuse_wait_in_process(mode)
        super().pause(mode, clear_cache)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        _refuse_wait_in_process(mode)
        super().sleep(level, mode)


def _refuse_wait_in_process(mode: str) -> None:
    """vLLM's rule: with the engine core in the caller's thread, nothing steps while it waits."""
    if mode == "wait":
        raise ValueError("'wait' mode can't be used with the engine core in this process (multiprocess=False): "
                         "its requests run only when the caller steps them")


def make_client(vllm_config: VllmConfig, multiprocess: bool, engine_address: str | None = None,
                launch: EngineLaunch | None = None) -> InprocClient | SyncMPClient:
    if engine_address is not None or multiprocess:
        return SyncMPClient(vllm_config, engine_address, launch=launch)
    if (vllm_config.device_config.device == "cpu" and vllm_config.parallel_config.tensor_parallel_size == 1
            and bound_cpu_lists(1) is not None):
        raise ValueError(f"{THREADS_BIND_ENV} binds the process that runs the model, and with multiprocess=False that "
                         "is this one (the caller's): run the engine core in its own process (multiprocess=True, "
                         f"LLM's default), or unset {THREADS_BIND_ENV}")
    return InprocClient(vllm_config)


# ---------------------------------------------------------------------------------------------
# What a multi-process client must release
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _EngineState:
    """Whether the engine core is gone; shared by a client and its death watch (never refers
    to the client, so a client dropped without shutdown() is still collected, and its
    finalizer then stops the engine-core process it spawned)."""

    engine_dead: bool = False
    dead_reason: str = ""
    shutting_down: bool = False

    def mark_dead(self, reason: str) -> None:
        if not self.engine_dead:
            self.engine_dead, self.dead_reason = True, reason


class _OnEngineDeath:
    """The death watch's callback: marks the engine dead and tells the client, if it lives."""

    def __init__(self, state: _EngineState, on_death: weakref.WeakMethod) -> None:
        self.state = state
        self.on_death = on_death

    def __call__(self, dead: list[BaseProcess]) -> None:
        self.state.mark_dead(f"the engine core process died (exit code {dead[0].exitcode})")
        callback = self.on_death()
        if callback is not None:
            callback()


def _release(state: _EngineState, resources: ProcessResources) -> None:
    state.shutting_down = True
    resources.release()


# ---------------------------------------------------------------------------------------------
# Multi-process clients
# ---------------------------------------------------------------------------------------------


class MPClient:
    """What the sync and async clients share: start or attach, one DEALER socket, the codec,
    death detection and cleanup."""

    def __init__(self, vllm_config: VllmConfig, engine_address: str | None, ctx: zmq.Context,
                 launch: EngineLaunch | None = None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.state = _EngineState()
        self.resources = ProcessResources(ctx)
        self._finalizer = weakref.finalize(self, _release, self.state, self.resources)
        atexit.register(self._finalizer)  # runs before multiprocessing's exit hook joins children
        self.attached = engine_address is not None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.engine_info: dict[str, Any] = {}
        try:
            self.address = self._start_or_attach(vllm_config, engine_address, launch)
            self.identity = uuid.uuid4().hex.encode()
            self.socket = make_socket(ctx, zmq.DEALER, connect=self.address, identity=self.identity)
        except BaseException:
            MPClient.shutdown(self)
            raise
        self.resources.sockets.append(self.socket)
        self.encoder = MsgpackEncoder()
        self.decoders = {tag: MsgpackDecoder(struct) for tag, struct in OUTPUT_STRUCTS.items()}
        self.ids_receiver = RequestIdsReceiver()
        self._call_ids = itertools.count()
        self._last_heard = time.monotonic()
        self._last_ping = 0.0

    @property
    def engine_pid(self) -> int | None:
        procs = self.resources.procs
        return procs[0].pid if procs else self.engine_info.get("pid")

    @property
    def num_kv_blocks(self) -> int:
        """The KV cache's size the engine core settled on (measured under gpu_memory_utilization)."""
        return self.engine_info["num_kv_blocks"]

    @property
    def is_engine_dead(self) -> bool:
        return self.state.engine_dead

    def shutdown(self) -> None:
        """Stop the engine-core process this client spawned (an attached engine keeps running),
        close the socket, remove the private ipc directory."""
        self._finalizer()
        atexit.unregister(self._finalizer)

    def _start_or_attach(self, vllm_config: VllmConfig, engine_address: str | None,
                         launch: EngineLaunch | None) -> str:
        if engine_address is not None:
            address = normalize_address(engine_address)
            self.engine_info = fetch_engine_info(address)
            return address
        launch = launch or launch_engine_core(vllm_config)
        self.resources.procs.append(launch.proc)
        self.resources.cleanups.append(launch.address.cleanup)
        self.engine_info = launch.wait_ready()
        self.resources.watch = DeathWatch([launch.proc], _OnEngineDeath(self.state, weakref.WeakMethod(
            self._on_engine_death)), name="engine-core-watch")
        return launch.address.address

    def _on_engine_death(self) -> None:
        """Called on the watcher thread once the spawned process is gone."""

    def _check_alive(self) -> None:
        if self.state.engine_dead:
            raise EngineDeadError(self.state.dead_reason)
        if self.state.shutting_down:
            raise EngineDeadError("the engine client was shut down")

    def _frames(self, request_type: bytes, message: Any) -> list[Any]:
        return [request_type, *self.encoder.encode(message)]

    def _decode(self, frames: list[zmq.Frame]) -> Any:
        """One engine message, or None (logged) if it cannot be read."""
        self._last_heard = time.monotonic()
        tag = frames[0].bytes
        decoder = self.decoders.get(tag)
        try:
            if decoder is None:
                raise msgspec.DecodeError(f"unknown message type {tag!r}")
            message = decoder.decode(frames[1:])
            return self.ids_receiver.restore(message) if tag == OutputType.OUTPUTS else message
        except Exception as exc:  # msgspec.DecodeError, RecursionError ...: costs this message only
            logger.error("engine client: dropped an unreadable engine message: %s", exc)
            return None

    def _silence_s(self, since: float) -> float:
        return time.monotonic() - max(self._last_heard, since)

    def _check_heartbeat(self, since: float) -> UtilityRequest | None:
        """An attached client's heartbeat, sync or async: after `heartbeat_timeout_s` of silence
        the engine is marked dead; after `heartbeat_interval_s` a ping is due (returned, for the
        caller to send its own way)."""
        silence = self._silence_s(since)
        if silence > self.heartbeat_timeout_s:
            self.state.mark_dead(f"the engine core at {self.address} has not answered for {silence:.1f} s")
        elif silence > self.heartbeat_interval_s and self._silence_s(self._last_ping) > self.heartbeat_interval_s:
            self._last_ping = time.monotonic()
            return UtilityRequest(next(self._call_ids), "is_healthy")
        return None


class SyncMPClient(MPClient):
    """For `LLM`: one caller thread sends and receives (not thread-safe)."""

    def __init__(self, vllm_config: VllmConfig, engine_address: str | None = None, *,
                 launch: EngineLaunch | None = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, engine_address, zmq.Context(), launch, **kwargs)
        self._pending: deque[Any] = deque()  # outputs that arrived while a utility call waited

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.state.engine_dead and not self.state.shutting_down:
            self._send(RequestType.ABORT, AbortRequests(list(request_ids)))

    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (blocks). A request the engine core rejected raises
        RequestRejectedError."""
        while True:
            message = self._pending.popleft() if self._pending else self._receive()
            if isinstance(message, EngineCoreOutputs):
                return message
            if isinstance(message, RequestError):
                raise RequestRejectedError(message.request_id, message.message, message.while_running)
            # Anything else is a utility answer nobody waits for (a heartbeat's).

    def try_get_output(self) -> EngineCoreOutputs | None:
        """A step's outputs that have arrived already, else None (never blocks; data-parallel
        clients read several engines so). A rejected request raises as in `get_output`."""
        while True:
            if self._pending:
                message = self._pending.popleft()
            else:
                self._check_alive()
                if not self.socket.poll(0):
                    return None
                message = self._decode(self.socket.recv_multipart(copy=False))
                if isinstance(message, EngineDead):
                    self.state.mark_dead(message.message)
                    self._check_alive()
            if isinstance(message, EngineCoreOutputs):
                return message
            if isinstance(message, RequestError):
                raise RequestRejectedError(message.request_id, message.message, message.while_running)

    def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """The call's result; TimeoutError after `timeout_s` (the engine core goes on with the
        call, and its late answer is dropped)."""
        call_id = next(self._call_ids)
        self._send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            message = self._receive(deadline)
            if message is None:
                raise TimeoutError(f"the engine core's {method} call did not finish within {timeout_s} s")
            if isinstance(message, UtilityResult):
                if message.call_id == call_id:
                    return utility_value(message)
            else:
                self._pending.append(message)

    def get_stats(self) -> dict[str, Any]:
        return self.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self.call_utility("reset_prefix_cache")

    def profile(self, is_start: bool, profile_prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        self.call_utility("profile", is_start, profile_prefix, delay_iterations, max_iterations)

    def collective_rpc(self, call: RpcCall, timeout_s: float | None = None) -> list[Any]:
        return [decode(result) for result in self.call_utility("collective_rpc", encode_call(call),
                                                               timeout_s=timeout_s)]

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.call_utility("pause", mode, clear_cache)

    def resume(self) -> None:
        self.call_utility("resume")

    def is_paused(self) -> bool:
        return self.call_utility("is_paused")

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.call_utility("sleep", level, mode)

    def release_kv_cache_memory(self) -> None:
        self.call_utility("release_kv_cache_memory")

    def set_weight_version(self, weight_version: str) -> None:
        self.call_utility("set_weight_version", weight_version)

    def get_weight_version(self) -> str:
        return self.call_utility("get_weight_version")

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.call_utility("is_sleeping")

    def is_healthy(self) -> bool:
        return self.call_utility("is_healthy")

    def _send(self, request_type: bytes, message: Any) -> None:
        self._check_alive()
        self.socket.send_multipart(self._frames(request_type, message), copy=False)

    def _receive(self, deadline: float | None = None) -> Any:
        """The next engine message; None once `deadline` (time.monotonic()) has passed."""
        since = time.monotonic()
        while True:
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if self.socket.poll(int(_POLL_S * 1000)):
                message = self._decode(self.socket.recv_multipart(copy=False))
                if isinstance(message, EngineDead):
                    self.state.mark_dead(message.message)
                elif message is not None:
                    return message
            elif self.attached and (ping := self._check_heartbeat(since)) is not None:
                self._send(RequestType.UTILITY, ping)


class AsyncMPClient(MPClient):
    """For `AsyncLLM`: lives on one asyncio event loop (the first one that uses it). A reader
    task moves engine messages to `get_output_async()` and answers utility calls."""

    def __init__(self, vllm_config: VllmConfig, engine_address: str | None = None, *,
                 launch: EngineLaunch | None = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, engine_address, zmq.asyncio.Context(), launch, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(RequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests_nowait(request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Safe where awaiting is not (a generator's cleanup); a no-op once the engine is gone."""
        if not request_ids or self.state.engine_dead or self.state.shutting_down:
            return
        sent = self.socket.send_multipart(self._frames(RequestType.ABORT, AbortRequests(list(request_ids))),
                                          copy=False)
        sent.add_done_callback(_log_send_failure)

    async def get_output_async(self) -> EngineCoreOutputs | RequestError:
        """The next engine message for requests: a step's outputs, or a rejected request."""
        self._ensure_started()
        message = await self._outputs.get()
        if isinstance(message, BaseException):
            self._outputs.put_nowait(message)  # every later caller learns it too
            raise message
        return message

    async def call_utility_async(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self._ensure_started()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._utility_futures[call_id] = future
        try:
            await self._send(RequestType.UTILITY, UtilityRequest(call_id, method, list(args)))
            return utility_value(await asyncio.wait_for(future, timeout_s))
        finally:
            self._utility_futures.pop(call_id, None)

    async def get_stats_async(self) -> dict[str, Any]:
        return await self.call_utility_async("get_stats")

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")

    async def profile_async(self, is_start: bool, profile_prefix: str | None = None,
                            delay_iterations: int | None = None, max_iterations: int | None = None) -> None:
        await self.call_utility_async("profile", is_start, profile_prefix, delay_iterations, max_iterations)

    async def collective_rpc_async(self, call: RpcCall, timeout_s: float | None = None) -> list[Any]:
        results = await self.call_utility_async("collective_rpc", encode_call(call), timeout_s=timeout_s)
        return [decode(result) for result in results]

    async def pause_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self.call_utility_async("pause", mode, clear_cache)

    async def resume_async(self) -> None:
        await self.call_utility_async("resume")

    async def is_paused_async(self) -> bool:
        return await self.call_utility_async("is_paused")

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        await self.call_utility_async("sleep", level, mode)

    async def release_kv_cache_memory_async(self) -> None:
        await self.call_utility_async("release_kv_cache_memory")

    async def set_weight_version_async(self, weight_version: str) -> None:
        await self.call_utility_async("set_weight_version", weight_version)

    async def get_weight_version_async(self) -> str:
        return await self.call_utility_async("get_weight_version")

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        return await self.call_utility_async("wake_up", tags)

    async def is_sleeping_async(self) -> bool:
        return await self.call_utility_async("is_sleeping")

    async def is_healthy_async(self) -> bool:
        return await self.call_utility_async("is_healthy")

    def shutdown(self) -> None:
        for task in self._tasks:
            if not task.get_loop().is_closed():
                task.cancel()
        self._fail_pending(EngineDeadError("the engine client was shut down"))
        super().shutdown()

    # ---- background tasks ----
    def _ensure_started(self) -> None:
        self._check_alive()
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._tasks.append(self._loop.create_task(self._read_loop(), name="engine-core-reader"))
        if self.attached:
            self._tasks.append(self._loop.create_task(self._heartbeat_loop(), name="engine-core-heartbeat"))

    async def _send(self, request_type: bytes, message: Any) -> None:
        self._ensure_started()
        await self.socket.send_multipart(self._frames(request_type, message), copy=False)

    async def _read_loop(self) -> None:
        while True:
            message = self._decode(await self.socket.recv_multipart(copy=False))
            if isinstance(message, UtilityResult):
                future = self._utility_futures.pop(message.call_id, None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, EngineDead):
                self._engine_died(message.message)
                return
            elif message is not None:
                self._outputs.put_nowait(message)

    async def _heartbeat_loop(self) -> None:
        since = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            ping = self._check_heartbeat(since)
            if self.state.engine_dead:
                self._engine_died(self.state.dead_reason)
                return
            if ping is not None:
                await self._send(RequestType.UTILITY, ping)

    # ---- death ----
    def _on_engine_death(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._engine_died, self.state.dead_reason)

    def _engine_died(self, reason: str) -> None:
        """On the loop: fail everything waiting, stop the background tasks."""
        self.state.mark_dead(reason)
        self._fail_pending(EngineDeadError(self.state.dead_reason))
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    def _fail_pending(self, error: EngineDeadError) -> None:
        if self._outputs is not None:
            self._outputs.put_nowait(error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(error.reason))
        self._utility_futures.clear()


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("engine client: a send failed: %s", future.exception())

