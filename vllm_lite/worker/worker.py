"""A worker owns one device: it sets the process up, holds the ModelRunner and the KV cache."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_lite.config import VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.worker.memory import (device_memory, host_memory, kv_cache_budget, resident_bytes,
                                     return_freed_memory)
from vllm_lite.model.checkpoint_files import iterate_weights
from vllm_lite.model.weight_updates import discard_weights, num_missing_weights, restore_weights
from vllm_lite.profiler_config import NOT_ENABLED
from vllm_lite.rpc import resolve_qualname
from vllm_lite.worker.model_runner import LaunchedStep, ModelRunner
from vllm_lite.worker.profiler import TorchProfiler
from vllm_lite.wire import ModelRunnerOutput


class Worker:
    def __init__(self, vllm_config: VllmConfig, tp: TensorParallelGroup = SINGLE_RANK,
                 local_rank: int = 0) -> None:
        device_name = vllm_config.device_config.device
        if device_name == "cuda":  # (a data-parallel engine's ranks take the GPUs after the engines before it)
            gpu = vllm_config.parallel_config.first_local_process + local_rank
            torch.cuda.set_device(gpu)
            self.device = torch.device("cuda", gpu)
        else:
            self.device = torch.device("cpu")
            keep_freed_memory_in_heap()
        self.vllm_config = vllm_config
        # Before the weights load: gpu_memory_utilization's share must have been free then.
        self.memory_at_start = (device_memory(self.device)
                                if vllm_config.cache_config.gpu_memory_utilization is not None else None)
        torch.manual_seed(vllm_config.model_config.seed)
        self.model_runner = ModelRunner(vllm_config, self.device, tp)
        self.rank = tp.rank
        self.local_rank = local_rank
        self.profiler: TorchProfiler | None = None  # made by the first start_profile

    def determine_available_memory(self) -> int:
        """The bytes this rank's KV cache may take under gpu_memory_utilization
        (`memory.kv_cache_budget`): on CUDA what a profile step leaves; on CPU, as vLLM's CPU
        backend, the host's memory less this process's resident set, shared by a host's ranks."""
        utilization = self.vllm_config.cache_config.gpu_memory_utilization
        if self.memory_at_start is None:  # (taken only when gpu_memory_utilization is set)
            raise ValueError("determine_available_memory: the KV cache has a fixed size (no gpu_memory_utilization)")
        if self.device.type == "cuda":
            used = self._profiled_cuda_use()
            return kv_cache_budget(utilization, self.memory_at_start, used, device_memory(self.device).free)
        parallel = self.vllm_config.parallel_config
        return kv_cache_budget(utilization, self.memory_at_start, resident_bytes(), host_memory().free,
                               sharers=parallel.model_processes_per_node, device="cpu")

    def _profiled_cuda_use(self) -> int:
        """This rank's peak use in the largest step: torch's peak allocation over a profile step
        (the weights included) plus what the CUDA runtime took outside torch's allocator."""
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_kv_cache = self.model_runner.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_kv_cache
        torch.cuda.empty_cache()
        gained = self.memory_at_start.free - device_memory(self.device).free
        return peak + max(0, gained - torch.cuda.memory_reserved(self.device))

    def initialize_kv_cache(self, num_blocks: int, num_state_slots: int = 0) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, num_state_slots)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep on this rank (the engine core has checked the level and that no request
        holds blocks): level 1 on CPU releases the KV cache; the weights stay in host memory,
        where level 1 keeps them."""
        if level == 1:
            self.model_runner.release_kv_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: what `sleep` released is back (a new, zeroed KV cache)."""
        if not self.model_runner.kv_caches and (tags is None or "kv_cache" in tags):
            self.model_runner.initialize_kv_cache(self.model_runner.num_kv_blocks, self.model_runner.num_state_slots)

    def reset_encoder_cache(self) -> None:
        """vLLM's: forget the image features kept for reuse (each image is encoded again)."""
        self.model_runner.reset_encoder_cache()

    def discard_weights(self) -> None:
        """Sleep level 2's part past level 1: the model's weights let go (model/weight_updates.py)."""
        discard_weights(self.get_model())
        return_freed_memory()

    def restore_weights(self) -> None:
        """wake_up(["weights"]) after level 2: the weights back (NaN until loaded) for a trainer to load."""
        restore_weights(self.get_model())

    def num_missing_weights(self) -> int:
        return num_missing_weights(self.get_model())

    def reload_weights(self, weights_iterator: Iterable[tuple[str, Any]] | None = None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        """vLLM's: the model's weights replaced in place (`model.load_weights`) from
        `weights_iterator`, or from the safetensors checkpoint in `weights_path` (this rank reads
        its part), or from the model's own checkpoint again."""
        if not is_checkpoint_format:
            raise ValueError("reload_weights(is_checkpoint_format=False): weights already in a kernel's layout are "
                             "not taken here; give the checkpoint's tensors")
        if weights_iterator is None:
            folder = Path(weights_path or self.vllm_config.model_config.model)
            if not folder.is_dir():
                raise ValueError(f"reload_weights: {str(folder)!r} is no checkpoint folder (safetensors files)")
            weights_iterator = iterate_weights(folder)
        self.get_model().load_weights(weights_iterator)

    def get_model(self) -> nn.Module:
        """vLLM's: this rank's model (`model.load_weights(weights)` updates its weights in place)."""
        return self.model_runner.model

    def apply_model(self, function: Callable[[nn.Module], Any]) -> Any:
        """vLLM's `LLM.apply_model` on this rank: `function(model)`."""
        return function(self.get_model())

    def stop_profiling(self) -> None:
        """At shutdown: a session still on writes its trace (as vLLM's)."""
        if self.profiler is not None:
            self.profiler.stop()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.profiler is None:
            return self.model_runner.execute_model(scheduler_output)
        with self.profiler.annotate_step():
            output = self.model_runner.execute_model(scheduler_output)
        self.profiler.step()
        return output

    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        if self.profiler is None:
            return self.model_runner.launch(scheduler_output)
        with self.profiler.annotate_step():
            return self.model_runner.launch(scheduler_output)

    def profile(self, is_start: bool, profile_prefix: str | None = None, delay_iterations: int | None = None,
                max_iterations: int | None = None) -> None:
        """start_profile / stop_profile on this rank, in the thread that runs its steps (the torch
        profiler records the thread that starts it). Traces are named as vLLM names them:
        `[<prefix>_]dp0_pp0_tp<rank>_dcp0_ep0_rank<rank>`."""
        config = self.vllm_config.profiler_config
        if not config.enabled:
            raise RuntimeError(NOT_ENABLED)
        if not is_start:
            if self.profiler is not None:
                self.profiler.stop()
            return
        name = f"dp0_pp0_tp{self.rank}_dcp0_ep0_rank{self.rank}"
        name = f"{profile_prefix}_{name}" if profile_prefix else name
        if self.profiler is None:
            self.profiler = TorchProfiler(config, self.device.type, name, log_table=self.rank == 0)
        self.profiler.set_name(name)
        self.profiler.start(delay_iterations, max_iterations)

    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        output = self.model_runner.finish(step)
        if self.profiler is not None:
            self.profiler.step()
        return output

    def needs_sampled_tokens_on_host(self) -> bool:
        return self.model_runner.needs_sampled_tokens_on_host()

    @staticmethod
    def step_thread_mode() -> torch.inference_mode:
        """What a thread that runs this worker's steps holds while it runs them (the engine-core
        loop, the uniproc step thread, a TP rank's loop): inference mode, entered once instead of
        by every step (`ModelRunner.launch` enters it only for a caller not in it; each entry
        costs tens of us on a CPU whose caches the forward pass has refilled)."""
        return torch.inference_mode()


def worker_class(vllm_config: VllmConfig) -> type[Worker]:
    """Worker, with vLLM's `worker_extension_cls` mixed in when one is set: its methods become
    the worker's, for `collective_rpc` to call by name. A name both classes define is refused
    (vLLM's rule: the extension adds, it does not replace)."""
    qualname = vllm_config.parallel_config.worker_extension_cls
    if not qualname:
        return Worker
    extension = resolve_qualname(qualname, "worker_extension_cls")
    if not isinstance(extension, type):
        raise ValueError(f"worker_extension_cls={qualname!r} is not a class")
    clashes = sorted(name for name in dir(extension) if not name.startswith("__") and hasattr(Worker, name))
    if clashes:
        raise ValueError(f"worker_extension_cls={qualname!r} defines {clashes}, which the worker has already; "
                         "an extension may only add methods")
    return type(f"Worker_{extension.__name__}", (Worker, extension), {})


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4


def keep_freed_memory_in_heap() -> None:
    """Make glibc reuse freed activation buffers instead of returning them to the OS.

    By default every buffer above 128 KiB-32 MiB gets fresh pages from mmap and gives them back
    on free, so each step's activations page-fault in again: on the demo model this made an
    elementwise op over a prefill's activations 10x slower (rms_norm 3.7 ms -> 0.26 ms for
    2,048 x 576 once fixed). No buffer is mapped on its own, whatever its size: raising the
    threshold to glibc's largest (32 MiB) left the larger ones (the LM head's logits of 1,024 rows
    x 8,192 ids are 32 MiB) faulting in 8,192 fresh pages every step, a third of the tiny model's
    step at 1,024 requests (benchmarks/RESULTS.md). The heap then keeps its peak size, as an
    inference process wants; with `LLM(..., multiprocess=False)` that process is the
    application's own.
    """
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc (musl has no mallopt)
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest allowed value on 64-bit
    mallopt(_M_MMAP_MAX, 0)  # glibc still maps what a thread's arena cannot hold (> 64 MiB)
    mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    mallopt(_M_TOP_PAD, 64 << 20)
