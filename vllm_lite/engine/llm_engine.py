"""The synchronous engine behind `LLM`: input processing, an engine-core client (in this
process, in a spawned process, or attached at an address), output processing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_lite.config import EngineArgs, VllmConfig
from vllm_lite.engine.core import check_sleep, check_wake_up_tags
from vllm_lite.engine.core_client import InprocClient, make_client
from vllm_lite.engine.dp_client import DPSyncClient, launch_engine_cores
from vllm_lite.exceptions import RequestRejectedError
from vllm_lite.engine.input_processor import InputProcessor, PromptType
from vllm_lite.engine.launch import launch_engine_core, load_tokenizer_while_launching, made_while_launching
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.parallel_sampling import fan_out
from vllm_lite.engine.profiling import ProfileSessions
from vllm_lite.engine.stats import IterationStats, StatLogger
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import EmbeddingRequestOutput, RequestOutput
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.rpc import make_call
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.wire import FinishReason


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, multiprocess: bool = False,
                 engine_address: str | None = None) -> None:
        self.vllm_config = vllm_config
        data_parallel = vllm_config.parallel_config.data_parallel_size > 1
        if data_parallel and (not multiprocess or engine_address is not None):
            raise ValueError("data_parallel_size > 1 starts its engine cores in their own processes: it needs "
                             "multiprocess=True and no engine_address")
        # Spawned engine cores load their models while this process loads the tokenizer.
        if data_parallel:
            launch = launch_engine_cores(vllm_config)
        else:
            launch = launch_engine_core(vllm_config) if multiprocess and engine_address is None else None
        self.tokenizer = load_tokenizer_while_launching(vllm_config, launch)
        self.input_processor = made_while_launching(launch, lambda: InputProcessor(
            vllm_config.model_config, self.tokenizer, vllm_config.lora_config))
        self.output_processor = OutputProcessor(self.tokenizer, vllm_config.scheduler_config.stream_interval)
        self.engine_core = (DPSyncClient(vllm_config, launch) if data_parallel
                            else make_client(vllm_config, multiprocess, engine_address, launch))
        # The KV cache's size is the engine core's (measured there under gpu_memory_utilization).
        self.vllm_config = vllm_config.with_num_kv_blocks(self.engine_core.num_kv_blocks)
        if isinstance(self.engine_core, InprocClient):
            # vLLM's, with the engine core in this process only: trainers (TRL, verl) reach the model
            # through it (`model_executor.driver_worker.worker.model_runner.model.load_weights`)
            self.model_executor = self.engine_core.executor
        self.profile_sessions = ProfileSessions(vllm_config.profiler_config)
        # Called with each step's IterationStats (LLM's metrics, when it keeps them).
        self.stat_loggers: list[StatLogger] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool = False,
                         engine_address: str | None = None) -> LLMEngine:
        return cls(engine_args.create_engine_config(), multiprocess, engine_address)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """n > 1 fans out into n engine-core requests (see parallel_sampling). `priority`: vLLM's
        (lower first), under the priority scheduling policy. `lora_request`: the adapter it runs with."""
        text, token_ids, request = self.input_processor.process_prompt(request_id, prompt, params, priority,
                                                                      lora_request)
        added = []
        try:
            for child, parent, index in fan_out(request):
                self.output_processor.add_request(child.request_id, text, token_ids, child.sampling_params,
                                                  parent=parent, index=index, lora_request=lora_request,
                                                  prompt_is_embeds=request.prompt_embeds is not None)
                added.append(child.request_id)
                self.engine_core.add_request(child)
        except Exception:
            self.abort_request(added)
            raise

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams | None = None,
                            priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """An embedding request (the pooling runner): its prompt's vector, as `params` says (None:
        the engine's pooler config), with the LoRA adapter `lora_request` (None: the base model)."""
        text, token_ids, request, pooling = self.input_processor.process_pooling(request_id, prompt, params, priority,
                                                                                lora_request)
        self.output_processor.add_request(request_id, text, token_ids, request.sampling_params, pooling=pooling)
        try:
            self.engine_core.add_request(request)
        except Exception:
            self.abort_request([request_id])
            raise

    # ---- LoRA adapters (vLLM's) ----
    def check_lora(self, lora_request: LoRARequest) -> None:
        """The adapter read and checked as a request naming it is (VLLMValidationError if it
        cannot serve); the workers load it with the first such request."""
        self.input_processor.check_lora(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: the adapter checked (`check_lora`) and known to the engine."""
        self.check_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: the id may name another adapter folder from now on."""
        return self.input_processor.forget_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.input_processor.lora_ids()

    def abort_request(self, request_ids: list[str]) -> None:
        aborted = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests([state.request_id for state in aborted])

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        try:
            outputs = self.engine_core.get_output()
        except RequestRejectedError as exc:  # multi-process: the rejection comes back later
            failed = IterationStats() if exc.while_running and self.stat_loggers else None
            reason = FinishReason.ERROR if exc.while_running else FinishReason.ABORT
            self.output_processor.abort_requests([exc.request_id], reason, failed)
            if failed is not None:  # (vllm:request_success's "error")
                for stat_logger in self.stat_loggers:
                    stat_logger(failed)
            raise
        iteration_stats = IterationStats(outputs.engine_index) if self.stat_loggers else None
        states, to_abort = self.output_processor.process_outputs(outputs, iteration_stats)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        if iteration_stats is not None:
            for stat_logger in self.stat_loggers:
                stat_logger(iteration_stats)
        return [out for state in states if (out := state.make_output()) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> dict[str, Any]:
        return {**self.engine_core.get_stats(), **self.input_processor.mm_cache_stats()}

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """vLLM's: every rank's torch profiler records from now (profiler_config)."""
        self.profile_sessions.begin(profile_prefix, delay_iterations, max_iterations)
        try:
            self.engine_core.profile(True, profile_prefix, delay_iterations, max_iterations)
        except BaseException:
            self.profile_sessions.failed()
            raise

    def stop_profile(self) -> None:
        """vLLM's: the ranks stop recording and write their traces."""
        self.profile_sessions.end()
        self.engine_core.profile(False)

    # ---- vLLM's sleep mode (level 0: pause; level 1 on CPU: the KV cache released) ----
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        check_sleep(level, mode, self.vllm_config.device_config.device)
        self.engine_core.sleep(level, mode)

    def release_kv_cache_memory(self) -> None:
        self.engine_core.release_kv_cache_memory()

    def set_weight_version(self, weight_version: str) -> None:
        self.engine_core.set_weight_version(weight_version)

    def get_weight_version(self) -> str:
        return self.engine_core.get_weight_version()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        check_wake_up_tags(tags)
        return self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: `method` (a worker method's name, or a function taking the worker first) on
        every rank; the results in rank order (vllm_lite/rpc.py)."""
        return self.engine_core.collective_rpc(make_call(method, args, kwargs), timeout)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
