"""vLLM's data parallelism (`data_parallel_size` N > 1): N engine cores, each a whole copy of the
model with its own tensor-parallel ranks (and its own KV cache and scheduler), and one client
that balances the requests between them, as vLLM's internal load balancer does: a new request
goes to the engine with the fewest unfinished requests of this client (the lowest rank on a tie).
A request stays on its engine (its aborts go there); the engines' outputs are merged as they come.
Calls that concern every engine go to all of them: stats are summed, `collective_rpc` results
listed engine by engine (each engine's ranks in order), profiling, pause, sleep and the prefix
cache on each. One engine dying is the engine's death (as in vLLM): every call fails from then on.

Engine d's processes take the CPU lists (VLLM_CPU_OMP_THREADS_BIND) or GPUs after the ranks of
engines 0..d-1 (`ParallelConfig.first_local_process`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq

from vllm_lite.config import VllmConfig
from vllm_lite.engine.core_client import _POLL_S, AsyncMPClient, SyncMPClient
from vllm_lite.engine.launch import EngineLaunch, launch_engine_core
from vllm_lite.exceptions import RequestRejectedError
from vllm_lite.rpc import RpcCall
from vllm_lite.wire import EngineCoreOutputs, EngineCoreRequest, RequestError


def engine_configs(vllm_config: VllmConfig) -> list[VllmConfig]:
    """Each data-parallel engine's config (its rank set)."""
    parallel = vllm_config.parallel_config
    return [dataclasses.replace(vllm_config, parallel_config=dataclasses.replace(parallel, data_parallel_rank=rank))
            for rank in range(parallel.data_parallel_size)]


def launch_engine_cores(vllm_config: VllmConfig) -> list[EngineLaunch]:
    """Every engine's process, started at once (they load their models side by side)."""
    launches: list[EngineLaunch] = []
    try:
        for config in engine_configs(vllm_config):
            launches.append(launch_engine_core(config))
    except BaseException:
        for launch in launches:
            launch.abort()
        raise
    return launches


def _engine_clients(vllm_config: VllmConfig, launches: list[EngineLaunch] | None,
                    make: Callable[[VllmConfig, EngineLaunch], Any]) -> list[Any]:
    """A client of each engine (`make(config, launch)`); if one cannot start, every engine is stopped."""
    launches = launches or launch_engine_cores(vllm_config)
    clients: list[Any] = []
    try:
        for config, launch in zip(engine_configs(vllm_config), launches):
            clients.append(make(config, launch))
    except BaseException:
        for client in clients:
            client.shutdown()
        for launch in launches[len(clients):]:
            launch.abort()
        raise
    return clients


class _Balance:
    """Which engine runs each of this client's unfinished requests, and how many each runs."""

    def __init__(self, num_engines: int) -> None:
        self.owner: dict[str, int] = {}
        self.load = [0] * num_engines

    def assign(self, request_id: str) -> int:
        engine = min(range(len(self.load)), key=self.load.__getitem__)
        self.owner[request_id] = engine
        self.load[engine] += 1
        return engine

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            engine = self.owner.pop(request_id, None)
            if engine is not None:
                self.load[engine] -= 1

    def by_engine(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.owner.get(request_id)
            if engine is not None:
                groups.setdefault(engine, []).append(request_id)
        return groups

    def seen(self, message: EngineCoreOutputs | RequestError) -> None:
        """A request the message ends is no longer its engine's."""
        if isinstance(message, RequestError):
            self.release([message.request_id])
        elif message.finished:
            self.release([finished.request_id for finished in message.finished])


def merged_stats(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The engines' stats as one engine's: counts summed (lists of counts element by element),
    adapter names joined; each engine's own under "per_engine" (the metrics' `engine` label)."""
    merged = dict(stats[0])
    for other in stats[1:]:
        for key, value in other.items():
            mine = merged.get(key)
            if isinstance(value, bool) or mine is None:
                merged.setdefault(key, value)
            elif isinstance(value, (int, float)):
                merged[key] = mine + value
            elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                merged[key] = [a + b for a, b in zip(mine, value)]
            elif isinstance(value, str):
                merged[key] = ",".join(dict.fromkeys(name for name in (*mine.split(","), *value.split(",")) if name))
    merged["per_engine"] = list(stats)
    return merged


class DPSyncClient:
    """For `LLM`: one SyncMPClient per engine."""

    def __init__(self, vllm_config: VllmConfig, launches: list[EngineLaunch] | None = None) -> None:
        self.clients: list[SyncMPClient] = _engine_clients(
            vllm_config, launches, lambda config, launch: SyncMPClient(config, launch=launch))
        self.balance = _Balance(len(self.clients))
        self._poller = zmq.Poller()
        for client in self.clients:
            self._poller.register(client.socket, zmq.POLLIN)
        self._next = 0  # the engine read first next time (each in turn: none is starved)

    @property
    def num_kv_blocks(self) -> int:
        return min(client.num_kv_blocks for client in self.clients)

    @property
    def is_engine_dead(self) -> bool:
        return any(client.is_engine_dead for client in self.clients)

    def add_request(self, request: EngineCoreRequest) -> None:
        engine = self.balance.assign(request.request_id)
        try:
            self.clients[engine].add_request(request)
        except BaseException:
            self.balance.release([request.request_id])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self.balance.by_engine(request_ids).items():
            self.clients[engine].abort_requests(ids)
        self.balance.release(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while True:
            for turn in range(len(self.clients)):
                engine = (self._next + turn) % len(self.clients)
                try:
                    outputs = self.clients[engine].try_get_output()
                except RequestRejectedError as exc:
                    self.balance.release([exc.request_id])
                    raise
                if outputs is not None:
                    self._next = (engine + 1) % len(self.clients)
                    outputs.engine_index = engine
                    self.balance.seen(outputs)
                    return outputs
            self._poller.poll(int(_POLL_S * 1000))

    def _all(self, method: str, *args: Any) -> list[Any]:
        return [getattr(client, method)(*args) for client in self.clients]

    def get_stats(self) -> dict[str, Any]:
        return merged_stats(self._all("get_stats"))

    def reset_prefix_cache(self) -> bool:
        return all(self._all("reset_prefix_cache"))

    def profile(self, *args: Any) -> None:
        self._all("profile", *args)

    def collective_rpc(self, call: RpcCall, timeout_s: float | None = None) -> list[Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results = []
        for client in self.clients:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            results += client.collective_rpc(call, left)
        return results

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self._all("pause", mode, clear_cache)

    def resume(self) -> None:
        self._all("resume")

    def is_paused(self) -> bool:
        return any(self._all("is_paused"))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._all("sleep", level, mode)

    def release_kv_cache_memory(self) -> None:
        self._all("release_kv_cache_memory")

    def set_weight_version(self, weight_version: str) -> None:
        self._all("set_weight_version", weight_version)

    def get_weight_version(self) -> str:
        return self.clients[0].get_weight_version()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return all(self._all("wake_up", tags))

    def is_sleeping(self) -> bool:
        return any(self._all("is_sleeping"))

    def is_healthy(self) -> bool:
        return all(self._all("is_healthy"))

    def shutdown(self) -> None:
        for client in self.clients:
            client.shutdown()


class DPAsyncClient:
    """For `AsyncLLM`: one AsyncMPClient per engine; a task per engine moves its outputs to one
    queue."""

    def __init__(self, vllm_config: VllmConfig, launches: list[EngineLaunch] | None = None, **kwargs: Any) -> None:
        self.clients: list[AsyncMPClient] = _engine_clients(
            vllm_config, launches, lambda config, launch: AsyncMPClient(config, launch=launch, **kwargs))
        self.balance = _Balance(len(self.clients))
        self._outputs: asyncio.Queue | None = None
        self._pumps: list[asyncio.Task] = []

    @property
    def num_kv_blocks(self) -> int:
        return min(client.num_kv_blocks for client in self.clients)

    @property
    def is_engine_dead(self) -> bool:
        return any(client.is_engine_dead for client in self.clients)

    @property
    def state(self) -> Any:
        """The state of the first engine that died (else the first engine's)."""
        return next((client.state for client in self.clients if client.is_engine_dead), self.clients[0].state)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        engine = self.balance.assign(request.request_id)
        try:
            await self.clients[engine].add_request_async(request)
        except BaseException:
            self.balance.release([request.request_id])
            raise

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        for engine, ids in self.balance.by_engine(request_ids).items():
            self.clients[engine].abort_requests_nowait(ids)
        self.balance.release(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs | RequestError:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
            self._pumps = [asyncio.get_running_loop().create_task(self._pump(rank, client), name=f"dp-engine-{rank}")
                           for rank, client in enumerate(self.clients)]
        message = await self._outputs.get()
        if isinstance(message, BaseException):
            self._outputs.put_nowait(message)  # every later caller learns it too
            raise message
        self.balance.seen(message)
        return message

    async def _pump(self, rank: int, client: AsyncMPClient) -> None:
        try:
            while True:
                message = await client.get_output_async()
                if isinstance(message, EngineCoreOutputs):
                    message.engine_index = rank
                self._outputs.put_nowait(message)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # (the engine died: the first death ends every reader)
            self._outputs.put_nowait(exc)

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(getattr(client, method)(*args) for client in self.clients)))

    async def get_stats_async(self) -> dict[str, Any]:
        return merged_stats(await self._all("get_stats_async"))

    async def reset_prefix_cache_async(self) -> bool:
        return all(await self._all("reset_prefix_cache_async"))

    async def profile_async(self, *args: Any) -> None:
        await self._all("profile_async", *args)

    async def collective_rpc_async(self, call: RpcCall, timeout_s: float | None = None) -> list[Any]:
        results = await self._all("collective_rpc_async", call, timeout_s)
        return [result for engine_results in results for result in engine_results]

    async def pause_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._all("pause_async", mode, clear_cache)

    async def resume_async(self) -> None:
        await self._all("resume_async")

    async def is_paused_async(self) -> bool:
        return any(await self._all("is_paused_async"))

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        await self._all("sleep_async", level, mode)

    async def release_kv_cache_memory_async(self) -> None:
        await self._all("release_kv_cache_memory_async")

    async def set_weight_version_async(self, weight_version: str) -> None:
        await self._all("set_weight_version_async", weight_version)

    async def get_weight_version_async(self) -> str:
        return await self.clients[0].get_weight_version_async()

    async def wake_up_async(self, tags: list[str] | None = None) -> bool:
        return all(await self._all("wake_up_async", tags))

    async def is_sleeping_async(self) -> bool:
        return any(await self._all("is_sleeping_async"))

    async def is_healthy_async(self) -> bool:
        return all(await self._all("is_healthy_async"))

    def shutdown(self) -> None:
        for task in self._pumps:
            if not task.get_loop().is_closed():
                task.cancel()
        for client in self.clients:
            client.shutdown()
