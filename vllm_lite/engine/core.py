"""EngineCore: scheduler + executor, one `step()` at a time. EngineCoreProc: the same core in
its own process, serving clients over ZMQ (`run_engine_core` is the process entry point)."""

from __future__ import annotations

import dataclasses
import enum
import gc
import logging
import os
import queue
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from vllm_lite.config import ModelConfig, VllmConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.cpu_info import bind_model_threads, model_threads
from vllm_lite.engine.core_io import CLIENT_GONE, EngineCoreIO
from vllm_lite.engine.request_checks import check_request
from vllm_lite.rpc import RpcCall, decode_call, encode
from vllm_lite.structured_output import StructuredOutputBackend, StructuredOutputManager
from vllm_lite.structured_output.backend import GrammarKey
from vllm_lite.wire import (
    PAUSE_MODES,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    FinishedRequest,
    FinishReason,
    ModelRunnerOutput,
    OutputType,
    RequestError,
    RequestType,
    UtilityRequest,
    UtilityResult,
)
from vllm_lite.engine.zmq_utils import EngineAddress
from vllm_lite.lifecycle import SignalPipe, freeze_startup_heap, on_parent_death

if TYPE_CHECKING:
    from vllm_lite.executor.abstract import Executor

logger = logging.getLogger(__name__)

_STOP_ENGINE = b"engine-stop"  # input-queue marker (never on the wire): SIGTERM/SIGINT came
MAX_RECENT_CLIENTS = 1024


def make_executor(vllm_config: VllmConfig) -> Executor:
    """`uni`: the worker runs in this process; `mp` (the default for tensor_parallel_size > 1):
    one worker process per rank; `external_launcher` (vLLM's): this process is one rank, of a
    torchrun job."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from vllm_lite.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(vllm_config)
    from vllm_lite.executor.uniproc import LauncherExecutor, UniProcExecutor

    return LauncherExecutor(vllm_config) if backend == "external_launcher" else UniProcExecutor(vllm_config)


# vLLM's wake_up tags: what a sleep put to sleep
SLEEP_TAGS = ("weights", "kv_cache", "scheduling")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")


def check_sleep(level: int, mode: str, device: str) -> None:
    """What `EngineCore.sleep` takes (clients check first, for a clear error where they are)."""
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
    check_pause_mode(mode)
    if level >= 1 and device != "cpu":
        raise ValueError(f"sleep(level={level}) on CUDA frees GPU memory through vLLM's CUDA memory pool, which is "
                         "not implemented here; level 0 pauses")
    if level >= 1 and mode == "keep":
        raise ValueError(f"sleep(level={level}, mode='keep') would release the KV cache of the requests it keeps; "
                         "use mode 'abort' or 'wait'")


def check_weights_discardable(model_config: ModelConfig) -> None:
    """sleep(level=2) needs weights a trainer can load again: the native models' float (or
    dequantized-at-load) weights, not layers kept quantized nor the Transformers fallback."""
    if model_config.hf.model_impl != "vllm":
        raise ValueError("sleep(level=2) discards the weights; the Transformers fallback's cannot be loaded again "
                         "here (level 1 releases the KV cache)")
    if model_config.pooler is not None:
        raise ValueError("sleep(level=2) discards the weights for a trainer to load new ones; a pooling model's "
                         "checkpoint has no LM head to load back, so it is not taken here (level 1 releases the "
                         "KV cache)")
    if model_config.quantization not in (None, "fp8", "bitsandbytes"):
        raise ValueError(f"sleep(level=2) discards the weights; quantization={model_config.quantization!r} keeps "
                         "layers quantized, which load_weights cannot load again (level 1 releases the KV cache)")


def check_wake_up_tags(tags: list[str] | None) -> None:
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags)):
        raise ValueError(f"wake_up tags must be a list of strings or None, got {tags!r}")
    unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
    if unknown:
        raise ValueError(f"wake_up tags must be among {SLEEP_TAGS}, got {unknown}")


class PauseState(enum.Enum):
    UNPAUSED = 0
    PAUSED_NEW = 1  # requests added meanwhile are held; those running go on ("abort", "wait")
    PAUSED_ALL = 2  # nothing runs ("keep")


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.executor = make_executor(vllm_config)
        try:
            num_blocks, num_state_slots = self._kv_cache_size()
            self.executor.initialize_kv_cache(num_blocks, num_state_slots)
        except BaseException:
            self.executor.shutdown()  # worker processes must not outlive a failed start
            raise
        self.num_kv_blocks = num_blocks
        self.structured_output_manager = make_structured_output_manager(vllm_config)
        lora_config = vllm_config.lora_config
        scheduler_config = vllm_config.scheduler_config
        if num_state_slots:  # (no more requests run at once than hold a linear-attention state)
            scheduler_config = dataclasses.replace(scheduler_config, max_num_seqs=num_state_slots)
        self.scheduler = Scheduler(scheduler_config, vllm_config.cache_config, num_blocks,
                                   self.structured_output_manager,
                                   max_loras=lora_config.max_loras if lora_config is not None else None,
                                   speculative_config=vllm_config.speculative_config)
        # Requests a step failed on (attributably): freed already, their clients not yet told.
        self.failed_requests: list[RequestError] = []
        self.async_scheduling = vllm_config.scheduler_config.async_scheduling
        self.in_flight: SchedulerOutput | None = None  # async: submitted, output not yet taken
        # async: the in-flight step's outputs, taken early (by `profile`): the next step returns them
        self.taken_early: EngineCoreOutputs | None = None
        # vLLM's pause (`pause`): requests added meanwhile wait here until `resume`; the requests a
        # pause aborted are reported by the next step
        self.pause_state = PauseState.UNPAUSED
        self.held_requests: list[EngineCoreRequest] = []
        self.aborted_by_pause: list[FinishedRequest] = []
        self.clear_cache_when_drained = False
        self.release_kv_when_drained = False  # a level-1 sleep waiting for its requests to finish
        self.kv_cache_released = False
        self.discard_weights_when_drained = False  # a level-2 sleep waiting for its requests to finish
        self.weights_discarded = False  # level 2: the weights let go, until wake_up(["weights"])
        self.weights_to_load = False  # woken weights (NaN) a trainer has still to load
        self.weight_version = "default"  # vLLM's label of the weights, on every step's outputs

    def _kv_cache_size(self) -> tuple[int, int]:
        """The KV cache's blocks and the requests that hold a linear-attention state at once (a
        hybrid model's; else 0): fixed by the config, or from what the workers measured free
        under gpu_memory_utilization (logged, as vLLM logs its "Available KV cache memory")."""
        config, cache = self.vllm_config, self.vllm_config.cache_config
        budget = self.executor.determine_available_memory() if cache.gpu_memory_utilization is not None else None
        num_blocks, num_slots = config.num_kv_blocks(budget), config.num_state_slots(budget)
        if budget is not None:
            logger.info("available KV cache memory: %.2f GiB (gpu_memory_utilization=%s): %d blocks of %d tokens",
                        budget / (1 << 30), cache.gpu_memory_utilization, num_blocks, cache.block_size)
        max_num_seqs = config.scheduler_config.max_num_seqs
        if num_slots and num_slots < max_num_seqs:
            logger.warning("at most %d requests run at once (max_num_seqs=%d): each one's linear-attention state "
                           "takes %.1f MiB, and the states may take half of the KV cache's memory at most", num_slots,
                           max_num_seqs, config.state_bytes_per_seq() / (1 << 20))
        return num_blocks, num_slots

    def add_request(self, request: EngineCoreRequest) -> None:
        check_request(request, self.vllm_config.model_config)
        if self.pause_state is not PauseState.UNPAUSED:
            if request.request_id in self.scheduler.requests or any(
                    held.request_id == request.request_id for held in self.held_requests):
                raise ValueError(f"request_id {request.request_id!r} is already in use")
            self.held_requests.append(request)
            return
        core_request = Request.from_engine_core_request(request)
        structured = request.sampling_params.structured_outputs
        if structured is not None:  # compiles on the manager's thread; the request waits for it
            core_request.structured_output_request = self.structured_output_manager.make_request(
                structured, tuple(request.sampling_params.stop_token_ids or ()))
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        if self.held_requests:
            aborted = set(request_ids)
            self.held_requests = [held for held in self.held_requests if held.request_id not in aborted]

    # ---- vLLM's pause / resume (what RL trainers do around weight updates) ----
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause_scheduler: requests added from now wait until `resume`. `mode`:
        "abort" aborts every request (their clients get finish_reason abort), "wait" lets the
        running ones finish (`is_drained` says when), "keep" freezes them too (no step runs).
        `clear_cache`: the prefix cache is forgotten once nothing runs (not with "keep")."""
        check_pause_mode(mode)
        self._finish_step_in_flight()
        if mode == "abort":
            self.aborted_by_pause += self.scheduler.abort_requests(list(self.scheduler.requests))
            self.aborted_by_pause += [FinishedRequest(held.request_id, FinishReason.ABORT)
                                      for held in self.held_requests]
            self.held_requests = []
        self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        self.clear_cache_when_drained = clear_cache and mode != "keep"
        self.when_drained()

    def is_drained(self) -> bool:
        """No request of those the pause let finish is left (what a "wait" pause waits for)."""
        return not self.scheduler.has_unfinished_requests() and self.in_flight is None

    def when_drained(self) -> None:
        """What a pause or sleep does once no request runs: forget the prefix cache, release the KV cache."""
        if not self.is_drained():
            return
        if self.clear_cache_when_drained:
            self.clear_cache_when_drained = False
            self.scheduler.reset_prefix_cache()
        if self.release_kv_when_drained:
            self.release_kv_when_drained = False
            self._release_kv_cache()
        if self.discard_weights_when_drained:
            self.discard_weights_when_drained = False
            self.executor.collective_rpc(RpcCall("discard_weights"))
            self.weights_discarded = True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep: level 0 pauses (`pause`, the prefix cache kept); level 1 also forgets
        the prefix cache and, once no request runs, releases every rank's KV cache (on CPU the
        weights already are in host memory, where level 1 puts them); level 2 also lets the
        weights go (a trainer loads new ones after `wake_up(["weights"])`). Levels 1 and 2 on
        CUDA (vLLM's CUDA memory pool) are not implemented: refused."""
        check_sleep(level, mode, self.vllm_config.device_config.device)
        if level == 2:
            check_weights_discardable(self.vllm_config.model_config)
        self.pause(mode, clear_cache=level >= 1)
        if level >= 1 and not self.kv_cache_released:
            self.release_kv_when_drained = True
        if level == 2 and not self.weights_discarded and not self.weights_to_load:
            self.discard_weights_when_drained = True
        self.when_drained()

    def release_kv_cache_memory(self) -> None:
        """vLLM's: after a completed pause with no request left (sleep level 0), every rank's KV
        cache is released as level 1 releases it (`wake_up(["kv_cache"])` brings it back)."""
        if not (self.is_paused() and self.is_drained() and not self.held_requests):
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first (sleep(level=0) with no "
                               "request left in the engine)")
        if self.kv_cache_released:
            raise RuntimeError("release_kv_cache_memory() requires all executor memory to be resident: the KV "
                               "cache is released already")
        self.scheduler.reset_prefix_cache()
        self._release_kv_cache()

    def _release_kv_cache(self) -> None:
        """Every rank's KV cache released (`Worker.sleep(1)`); `wake_up` makes a new one."""
        self.executor.collective_rpc(RpcCall("sleep", (1,)))
        self.kv_cache_released = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: what sleep released is back (`tags` None: all of it), and once nothing is
        left asleep the engine resumes; returns whether it did."""
        check_wake_up_tags(tags)
        self.release_kv_when_drained = self.discard_weights_when_drained = False
        if self.weights_discarded and (tags is None or "weights" in tags):
            self.executor.collective_rpc(RpcCall("restore_weights"))
            self.weights_discarded, self.weights_to_load = False, True
        if self.kv_cache_released and (tags is None or "kv_cache" in tags):
            self.executor.collective_rpc(RpcCall("wake_up", (tags,)))
            self.kv_cache_released = False
        if self.kv_cache_released or self.weights_discarded:
            return False
        if self.weights_to_load:
            missing = sum(self.executor.collective_rpc(RpcCall("num_missing_weights")))
            if missing:
                raise RuntimeError(f"sleep(level=2) let the weights go and {missing} parameters (over the ranks) have "
                                   "not been loaded whole since wake_up(['weights']) (each shard of a fused layer "
                                   "counts: q, k and v, gate and up): load them (model.load_weights through "
                                   "collective_rpc, or collective_rpc('reload_weights')) before the engine resumes")
            self.weights_to_load = False
        self.resume()
        return True

    def is_sleeping(self) -> bool:
        return self.is_paused() or self.kv_cache_released or self.weights_discarded

    def set_weight_version(self, weight_version: str) -> None:
        """vLLM's: the label of the weights from the next step on (a trainer sets it after an update)."""
        if not isinstance(weight_version, str) or not weight_version:
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
        self.weight_version = weight_version

    def get_weight_version(self) -> str:
        return self.weight_version

    def resume(self) -> None:
        """vLLM's resume_scheduler: the requests held meanwhile are added, in order (one that
        can no longer be added fails on its own)."""
        self.pause_state = PauseState.UNPAUSED
        self.clear_cache_when_drained = False
        held, self.held_requests = self.held_requests, []
        for request in held:
            try:
                self.add_request(request)
            except (ValueError, TypeError) as exc:
                self.failed_requests.append(RequestError(request.request_id, str(exc)))

    def is_paused(self) -> bool:
        return self.pause_state is not PauseState.UNPAUSED

    def step(self) -> EngineCoreOutputs:
        if self.pause_state is PauseState.PAUSED_ALL:
            outputs = self._paused_step()
        else:
            outputs = self._step_async() if self.async_scheduling else self._step_sync()
        if self.aborted_by_pause:
            outputs.finished.extend(self.aborted_by_pause)
            self.aborted_by_pause = []
        outputs.weight_version = self.weight_version
        if self.clear_cache_when_drained or self.release_kv_when_drained:
            self.when_drained()
        if self.scheduler.step_failures:  # freed by the scheduler; their clients get an error
            self._report_failures(self.scheduler.take_step_failures())
        return outputs

    def _paused_step(self) -> EngineCoreOutputs:
        """Frozen ("keep"): no step runs; the outputs of the step the pause finished go out."""
        outputs, self.taken_early = self.taken_early, None
        return outputs if outputs is not None else EngineCoreOutputs([], np.zeros(0, dtype=np.int32))

    def _step_sync(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        failed = self.scheduler.take_failed() if self.scheduler.failed else []
        if sched.is_empty:
            self._wait_for_grammars()
            return EngineCoreOutputs([], np.zeros(0, dtype=np.int32), failed)
        outputs = self._update_from_output(sched, self.executor.execute_model(sched))
        if failed:
            outputs.finished.extend(failed)
        return outputs

    def _step_async(self) -> EngineCoreOutputs:
        """Schedule and submit step N+1, then wait for step N and update from its output: the
        scheduling here, and what the caller does with the outputs before the next call, overlap
        the model running step N+1. Returns step N's outputs."""
        drained, self.taken_early = self.taken_early, None
        if self.in_flight is not None and (self.in_flight.structured_output_req_ids
                                           or self.in_flight.needs_output_first):
            # Constrained requests sample in it: their next bitmask needs those tokens first.
            drained = self._finish_in_flight()
        sched = self.scheduler.schedule()
        failed = self.scheduler.take_failed() if self.scheduler.failed else []
        previous, self.in_flight = self.in_flight, None
        if not sched.is_empty:
            self.executor.submit_model(sched)
            self.in_flight = sched
        if previous is not None:
            outputs = self._update_from_output(previous, self.executor.take_model_output())
        elif drained is not None:
            outputs = drained
        else:
            if sched.is_empty:
                self._wait_for_grammars()
            outputs = EngineCoreOutputs([], np.zeros(0, dtype=np.int32))
        if failed:
            outputs.finished.extend(failed)
        return outputs

    def _finish_in_flight(self) -> EngineCoreOutputs:
        sched, self.in_flight = self.in_flight, None
        return self._update_from_output(sched, self.executor.take_model_output())

    def _update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(sched, out.req_ids, out.sampled_token_ids, out.num_sampled,
                                                    out.logprobs, out.prompt_logprobs, out.failed,
                                                    every_row_sampled=out.every_row_sampled,
                                                    more_logprobs=(out.more_logprobs, out.more_logprobs_at))
        if out.pooled:  # (the vectors of requests that are still the engine's: they come with their token)
            taken = set(outputs.req_ids)
            outputs.pooled = {r: vector for r, vector in out.pooled.items() if r in taken}
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing could run: when requests wait for their grammar, sleep until one compiles
        (at most a few ms, so new inputs are still taken promptly) instead of spinning."""
        if self.scheduler.structured_req_ids:
            pending = self.scheduler.waiting_grammars()
            if pending:
                self.structured_output_manager.wait_for_any(pending, timeout=0.005)

    def _report_failures(self, failed: dict[str, str]) -> None:
        """These requests failed on their own (each failure its own) and the scheduler freed
        them (the workers drop them with the next step's finished ids): queue an error for each."""
        self.failed_requests.extend(RequestError(request_id, f"the request failed {message}", while_running=True)
                                    for request_id, message in failed.items())

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step whose output is still to be taken (async), or aborts
        or failures to report (a held request that could not be added on resume); frozen by a
        "keep" pause, only the last three."""
        if self.aborted_by_pause or self.taken_early is not None or self.failed_requests:
            return True
        if self.pause_state is PauseState.PAUSED_ALL:
            return False
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def profile(self, is_start: bool, profile_prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        """start_profile / stop_profile on every rank, between steps: a step in flight (async
        scheduling) is finished first, its outputs kept for the next `step`."""
        self._finish_step_in_flight()
        self.executor.profile(is_start, profile_prefix, delay_iterations, max_iterations)

    def collective_rpc(self, call: RpcCall) -> list[Any]:
        """vLLM's: `call` on every rank's worker, between steps (as `profile`); the results in
        rank order."""
        self._finish_step_in_flight()
        return self.executor.collective_rpc(call)

    def _finish_step_in_flight(self) -> None:
        """Async scheduling: the step in flight is finished now, its outputs kept for the next `step`."""
        if self.in_flight is not None:
            self.taken_early = self._finish_in_flight()

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.get_stats()
        stats["num_waiting"] += len(self.held_requests)  # (added while paused: they wait too)
        stats["sleep_level"] = self.sleep_level()
        return stats

    def sleep_level(self) -> int | None:
        """vLLM's vllm:engine_sleep_state: None awake; 0 paused, 1 the KV cache released, 2 the
        weights discarded too."""
        if self.weights_discarded:
            return 2
        if self.kv_cache_released:
            return 1
        return 0 if self.is_paused() else None

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()


def make_structured_output_manager(vllm_config: VllmConfig) -> StructuredOutputManager:
    """The backend, and the tokenizer vocabulary it needs, are loaded (on the compile thread)
    only when the first structured-output request arrives."""
    model_config = vllm_config.model_config

    def make_backend() -> StructuredOutputBackend:
        from vllm_lite.engine.tokenizer import end_token_ids, load_tokenizer
        from vllm_lite.structured_output.xgrammar_backend import XgrammarBackend

        tokenizer = load_tokenizer(model_config.tokenizer)
        stop_ids = end_token_ids(model_config.hf.eos_token_ids, tokenizer, model_config.hf.vocab_size)
        return XgrammarBackend(tokenizer, model_config.hf.vocab_size, list(stop_ids))

    def validate(key: GrammarKey) -> None:
        from vllm_lite.structured_output.xgrammar_backend import XgrammarBackend

        XgrammarBackend.validate(key)

    spec = vllm_config.speculative_config
    return StructuredOutputManager(make_backend, vllm_config.scheduler_config.max_num_seqs, validate,
                                   1 if spec is None else 1 + spec.num_speculative_tokens)


# ---------------------------------------------------------------------------------------------
# The engine core in its own process
# ---------------------------------------------------------------------------------------------


class EngineCoreProc:
    """EngineCore serving clients over ZMQ (see core_io.py for the two I/O threads).

    The busy loop: take every queued input (blocking only while there is no work), step, hand
    the step's outputs to the output thread. Clients are told apart by their socket identity;
    each gets only the outputs of its own requests, and may abort only those."""

    def __init__(self, vllm_config: VllmConfig, address: str) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.io = EngineCoreIO(address, self.input_queue, self.output_queue)  # binds now
        try:
            self.engine_core = EngineCore(vllm_config)
        except BaseException:
            self.io.close()
            raise
        self.vllm_config = vllm_config
        self.owners: dict[str, bytes] = {}  # request id -> client identity
        self.client_requests: dict[bytes, set[str]] = {}  # client identity -> its live requests
        # Clients heard from lately, idle ones included (told when the engine stops); bounded.
        self.recent_clients: OrderedDict[bytes, None] = OrderedDict()
        self.num_steps = 0
        self.utilities: dict[str, Callable[..., Any]] = {
            "get_stats": self.get_stats,
            "is_healthy": lambda: True,
            "reset_prefix_cache": self.engine_core.reset_prefix_cache,
            "engine_info": self.engine_info,
            "profile": self.engine_core.profile,
            "collective_rpc": self.collective_rpc,
            "pause": self.pause,
            "resume": self.engine_core.resume,
            "is_paused": self.engine_core.is_paused,
            "sleep": self.sleep,
            "release_kv_cache_memory": self.engine_core.release_kv_cache_memory,
            "wake_up": self.engine_core.wake_up,
            "is_sleeping": self.engine_core.is_sleeping,
            "set_weight_version": self.engine_core.set_weight_version,
            "get_weight_version": self.engine_core.get_weight_version,
        }
        # (client, call id) of "wait" pauses, answered once the running requests have finished
        self.drain_waiters: list[tuple[bytes, int]] = []

    @property
    def address(self) -> str:
        return self.io.address

    def serve(self) -> int:
        """Run until SIGTERM/SIGINT (SystemExit) or a fatal error; returns the exit code."""
        freeze_startup_heap()
        self.io.start()
        try:
            self.run_busy_loop()
        except SystemExit:
            self._broadcast_dead("the engine core was stopped")
            return 0
        except Exception as exc:
            logger.exception("engine core: fatal error in the busy loop")
            self._broadcast_dead(f"the engine core failed: {type(exc).__name__}: {exc}")
            return 1
        finally:
            self.shutdown()
        return 0

    def run_busy_loop(self) -> None:
        with self.engine_core.executor.step_thread_mode():
            while True:
                self._process_input_queue()
                self._process_engine_step()

    def shutdown(self) -> None:
        self.io.close()
        self.engine_core.shutdown()

    # ---- the loop, one level down ----
    def _process_input_queue(self) -> None:
        if not self.engine_core.has_unfinished_requests():
            self._handle_input(*self.input_queue.get())  # idle: block until a client speaks
        while not self.input_queue.empty():  # (only this thread takes from the queue)
            self._handle_input(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        if not self.engine_core.has_unfinished_requests():
            return
        outputs = self.engine_core.step()
        self.num_steps += 1
        if _has_content(outputs):
            self._send_outputs(outputs)
        if self.engine_core.failed_requests:
            self._send_failures()
        if self.drain_waiters:
            self._answer_drain_waiters()

    def _answer_drain_waiters(self) -> None:
        if self.engine_core.is_drained():
            for identity, call_id in self.drain_waiters:
                self.output_queue.put((identity, OutputType.UTILITY_RESULT, UtilityResult(call_id)))
            self.drain_waiters = []

    def _send_failures(self) -> None:
        errors, self.engine_core.failed_requests = self.engine_core.failed_requests, []
        for error in errors:
            identity = self.owners.get(error.request_id)
            if identity is not None:
                self.output_queue.put((identity, OutputType.ERROR, error))
        self._release([error.request_id for error in errors])

    def _handle_input(self, identity: bytes, request_type: bytes, message: Any) -> None:
        self._remember_client(identity, request_type)
        if request_type == RequestType.ADD:
            self._add_request(identity, message)
        elif request_type == RequestType.ABORT:
            self._abort_requests(identity, message.request_ids)
        elif request_type == RequestType.UTILITY:
            result = self._call_utility(message)
            if result.result is _WHEN_DRAINED:
                self.drain_waiters.append((identity, message.call_id))
                self._answer_drain_waiters()
            else:
                self.output_queue.put((identity, OutputType.UTILITY_RESULT, result))
        elif request_type == CLIENT_GONE:
            self._abort_requests(identity, list(self.client_requests.get(identity, ())))
        elif request_type == _STOP_ENGINE:
            raise SystemExit(0)

    def _remember_client(self, identity: bytes, request_type: bytes) -> None:
        if request_type == CLIENT_GONE:
            self.recent_clients.pop(identity, None)
        elif identity:
            self.recent_clients[identity] = None
            self.recent_clients.move_to_end(identity)
            if len(self.recent_clients) > MAX_RECENT_CLIENTS:
                self.recent_clients.popitem(last=False)

    def _add_request(self, identity: bytes, request: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(request)
        except Exception as exc:  # a refused request is answered, never fatal
            if not isinstance(exc, (ValueError, TypeError)):
                logger.exception("engine core: unexpected error adding request %r", request.request_id)
            self.output_queue.put((identity, OutputType.ERROR, RequestError(request.request_id, str(exc))))
            return
        self.owners[request.request_id] = identity
        self.client_requests.setdefault(identity, set()).add(request.request_id)

    def _abort_requests(self, identity: bytes, request_ids: list[str]) -> None:
        owned = [rid for rid in request_ids if self.owners.get(rid) == identity]
        if owned:
            self.engine_core.abort_requests(owned)
            self._release(owned)

    def _call_utility(self, call: UtilityRequest) -> UtilityResult:
        method = self.utilities.get(call.method)
        if method is None:
            return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}; "
                                                     f"known: {sorted(self.utilities)}")
        try:
            return UtilityResult(call.call_id, method(*call.args))
        except Exception as exc:  # a failed call is answered, never fatal
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    # ---- outputs to their clients ----
    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        if len(self.client_requests) == 1:
            (identity,) = self.client_requests
            self.output_queue.put((identity, OutputType.OUTPUTS, outputs))
        else:
            for identity, request_ids in self.client_requests.items():
                part = select_requests(outputs, request_ids)
                if _has_content(part):
                    self.output_queue.put((identity, OutputType.OUTPUTS, part))
        if outputs.finished:
            self._release([finished.request_id for finished in outputs.finished])

    def _release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            identity = self.owners.pop(request_id, None)
            owned = self.client_requests.get(identity)
            if owned is not None:
                owned.discard(request_id)
                if not owned:
                    del self.client_requests[identity]

    def _broadcast_dead(self, message: str) -> None:
        """Every client with requests in flight, and every client heard from lately (idle
        attached ones too), hears it at once; any other on its next call."""
        for identity in dict.fromkeys([*self.client_requests, *self.recent_clients]):
            self.output_queue.put((identity, OutputType.ENGINE_DEAD, EngineDead(message)))

    # ---- utilities ----
    def get_stats(self) -> dict[str, Any]:
        """The scheduler's stats plus busy-loop and garbage-collector counters
        (benchmarks/engine_gc.py reads the latter)."""
        stats = self.engine_core.get_stats()
        stats["num_steps"] = self.num_steps
        stats["num_clients"] = len(self.client_requests)
        stats["gc_collections"] = [generation["collections"] for generation in gc.get_stats()]
        stats["gc_count"] = list(gc.get_count())
        stats["gc_threshold"] = list(gc.get_threshold())
        return stats

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> Any:
        """The utility: a "wait" pause is answered once the running requests have finished
        (the loop goes on stepping them meanwhile)."""
        self.engine_core.pause(mode, clear_cache)
        return _WHEN_DRAINED if mode == "wait" else None

    def sleep(self, level: int = 1, mode: str = "abort") -> Any:
        """The utility: as `pause`, a "wait" sleep is answered once its requests have finished."""
        self.engine_core.sleep(level, mode)
        return _WHEN_DRAINED if mode == "wait" else None

    def collective_rpc(self, call: bytes) -> list[bytes]:
        """The utility: a call and its results in `vllm_lite.rpc`'s encoding (the client's)."""
        return [encode(result) for result in self.engine_core.collective_rpc(decode_call(call))]

    def engine_info(self) -> dict[str, Any]:
        """What an attaching client needs to build a matching input side."""
        model_config, lora = self.vllm_config.model_config, self.vllm_config.lora_config
        pooler = model_config.pooler
        return {"model": model_config.model, "tokenizer": model_config.tokenizer,
                "max_model_len": model_config.max_model_len, "pid": os.getpid(),
                "num_kv_blocks": self.engine_core.num_kv_blocks, "runner": model_config.runner,
                "pooler_config": None if pooler is None else {"pooling_type": pooler.pooling_type,
                                                              "use_activation": pooler.normalize},
                # (the client checks requests' adapters and processor arguments as the engine takes them)
                "lora": None if lora is None else {"max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank,
                                                   "max_cpu_loras": lora.max_cpu_loras,
                                                   "lora_target_modules": list(lora.target_modules or []) or None},
                "logits_processors": list(model_config.logits_processors)}


_WHEN_DRAINED = object()  # a utility's answer that waits until no request runs


def select_requests(outputs: EngineCoreOutputs, request_ids: set[str]) -> EngineCoreOutputs:
    """The part of a step's outputs that belongs to `request_ids` (one client's requests).
    Knows every field of EngineCoreOutputs (tests/engine/test_protocol.py checks that)."""
    rows = [i for i, request_id in enumerate(outputs.req_ids) if request_id in request_ids]
    index = np.asarray(rows, dtype=np.intp)
    changes: dict[str, Any] = {
        "req_ids": [outputs.req_ids[i] for i in rows],
        "finished": [f for f in outputs.finished if f.request_id in request_ids],
        "num_cached_tokens": {r: n for r, n in outputs.num_cached_tokens.items() if r in request_ids},
        "scheduling_times": {r: t for r, t in outputs.scheduling_times.items() if r in request_ids},
        "pooled": {r: v for r, v in outputs.pooled.items() if r in request_ids},
    }
    for name in _ROW_ARRAYS:
        value = getattr(outputs, name)
        if value is not None:
            changes[name] = value[index]
    if outputs.prompt_logprobs_req_ids:
        changes.update(_select_prompt_logprobs(outputs, request_ids))
    return msgspec.structs.replace(outputs, **changes)


# Arrays with one row per entry of `req_ids`.
_ROW_ARRAYS = ("new_token_ids", "logprob_token_ids", "logprobs", "logprob_ranks", "more_token_ids",
               "num_draft_tokens", "num_accepted_drafts", "more_logprob_token_ids", "more_logprobs",
               "more_logprob_ranks")
# Arrays with rows grouped per entry of `prompt_logprobs_req_ids` by `prompt_logprobs_offsets`.
_PROMPT_ROW_ARRAYS = ("prompt_logprob_token_ids", "prompt_logprobs", "prompt_logprob_ranks")
# `timestamp`, `weight_version` and `engine_index` are the step's, the same for every client; the
# `req_ids` numbering is set per client after selection (`RequestIdsSender`, in the output thread).
SELECTED_FIELDS = frozenset(("req_ids", "finished", "num_cached_tokens", "scheduling_times", "timestamp", "pooled",
                             "weight_version", "engine_index",
                             "req_ids_number", "repeats_req_ids_of",
                             *_ROW_ARRAYS, *_PROMPT_ROW_ARRAYS,
                             "prompt_logprobs_req_ids", "prompt_logprobs_starts", "prompt_logprobs_offsets"))


def _select_prompt_logprobs(outputs: EngineCoreOutputs, request_ids: set[str]) -> dict[str, Any]:
    keep = [j for j, r in enumerate(outputs.prompt_logprobs_req_ids) if r in request_ids]
    if not keep:
        return {name: None for name in (*_PROMPT_ROW_ARRAYS, "prompt_logprobs_starts",
                                         "prompt_logprobs_offsets")} | {"prompt_logprobs_req_ids": []}
    offsets = outputs.prompt_logprobs_offsets
    rows = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in keep])
    lengths = np.array([offsets[j + 1] - offsets[j] for j in keep], dtype=np.int32)
    changes: dict[str, Any] = {name: getattr(outputs, name)[rows] for name in _PROMPT_ROW_ARRAYS
                               if getattr(outputs, name) is not None}
    changes["prompt_logprobs_req_ids"] = [outputs.prompt_logprobs_req_ids[j] for j in keep]
    changes["prompt_logprobs_starts"] = outputs.prompt_logprobs_starts[keep]
    changes["prompt_logprobs_offsets"] = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    return changes


def _has_content(outputs: EngineCoreOutputs) -> bool:
    # Prompt logprobs of a prefill chunk can come without any sampled token.
    return bool(outputs.req_ids or outputs.finished or outputs.prompt_logprobs_req_ids)


# ---------------------------------------------------------------------------------------------
# Process entry points
# ---------------------------------------------------------------------------------------------


def run_engine_core(vllm_config: VllmConfig, address: str, ready: Callable[[bytes], None] | None = None,
                    standalone: bool = False) -> int:
    """Build an EngineCoreProc at `address` and serve until told to stop; returns the exit code.

    `ready` is called once with the start-up report: msgpack `{"address": ..., **engine_info}`
    when serving, or `{"error_type": ..., "message": ...}` when start-up failed."""
    stop = StopSignals(standalone)
    _watch_parent(stop)
    _set_torch_threads(vllm_config)
    try:
        proc = EngineCoreProc(vllm_config, address)
    except BaseException as exc:  # a bad model, an address in use, KeyboardInterrupt ...
        logger.exception("engine core: start-up failed")
        if ready is not None:
            ready(msgspec.msgpack.encode({"error_type": type(exc).__name__, "message": str(exc)}))
        return 1
    if ready is not None:
        ready(msgspec.msgpack.encode({"address": proc.address, **proc.engine_info()}))
    stop.notify(proc.input_queue)
    return proc.serve()


def spawned_engine_core_main(vllm_config: VllmConfig, address: EngineAddress, ready_pipe: Connection) -> None:
    """Target of the process a client spawns: report start-up on `ready_pipe`; stop when told
    (SIGTERM) or when the parent dies, and then remove the private ipc directory (the client
    does too, unless it was killed)."""
    try:
        code = run_engine_core(vllm_config, address.address, ready_pipe.send_bytes)
    finally:
        address.cleanup()
    ready_pipe.close()
    sys.exit(code)


class StopSignals:
    """SIGTERM (and, for a standalone engine core, SIGINT) stop the engine core, as does the
    death of the client that spawned it. Whichever thread the kernel hands a signal to, a watcher
    thread sees it on a SignalPipe and tells the busy loop through the input queue (a main
    thread blocked on the queue would not wake up for a Python handler)."""

    def __init__(self, standalone: bool) -> None:
        if not standalone:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the client to handle
        self._signals = SignalPipe((signal.SIGTERM, signal.SIGINT) if standalone else (signal.SIGTERM,))
        self.received = threading.Event()
        self._input_queue: queue.Queue | None = None
        threading.Thread(target=self._wait, name="engine-core-signals", daemon=True).start()

    def notify(self, input_queue: queue.Queue) -> None:
        """From now on a stop goes to `input_queue` (at once if one came during start-up)."""
        self._input_queue = input_queue
        if self.received.is_set():
            input_queue.put((b"", _STOP_ENGINE, None))

    def request(self) -> None:
        self.received.set()
        if self._input_queue is not None:
            self._input_queue.put((b"", _STOP_ENGINE, None))

    def _wait(self) -> None:
        self._signals.wait()
        self.request()


def _set_torch_threads(vllm_config: VllmConfig) -> None:
    """This process's intra-op threads; where it runs the model itself (one rank), bound to
    VLLM_CPU_OMP_THREADS_BIND's CPUs when that names them (cpu_info.bind_model_threads)."""
    if vllm_config.device_config.device == "cpu":
        import torch

        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size == 1:
            threads = bind_model_threads(parallel.first_local_process, parallel.model_processes_per_node)
        else:
            threads = model_threads()
        torch.set_num_threads(threads)


def _watch_parent(stop: StopSignals) -> None:
    """A spawned engine core stops when the process that spawned it dies (even by SIGKILL)."""
    on_parent_death(stop.request, name="engine-core-parent-watch")
