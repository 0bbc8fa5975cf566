"""AsyncLLM: asyncio streaming over a multi-process engine core.

```python
engine = AsyncLLM.from_engine_args(EngineArgs(model=...))     # spawns the engine core
engine = AsyncLLM.connect("ipc:///run/engine.sock")            # or attaches to a running one
async for out in engine.generate(prompt, params, request_id):  # cumulative, delta or final only
    ...
```

One output-handler task reads EngineCoreOutputs, runs the OutputProcessor (detokenize, stop
strings) and puts each RequestOutput in its request's RequestOutputCollector, where `generate`
picks it up; a slow consumer finds its outputs merged into one (bounded memory), and one that
stops reading for `max_unread_outputs` steps has its request aborted. One step's outputs are
processed `output_chunk_size` requests at a time, yielding to the event loop between chunks
(vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE), so a large batch does not hold the loop for the whole
step. A generator that ends early (cancelled task, `break`, closed) aborts its request in the
engine core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from vllm_lite.config import EngineArgs, VllmConfig
from vllm_lite.engine.core import check_pause_mode, check_sleep, check_wake_up_tags
from vllm_lite.engine.core_client import AsyncMPClient
from vllm_lite.engine.dp_client import DPAsyncClient, launch_engine_cores
from vllm_lite.exceptions import AdmissionRejectedError, EngineDeadError, RequestAbortedError, RequestRejectedError
from vllm_lite.engine.input_processor import InputProcessor, PromptType
from vllm_lite.engine.launch import (attached_engine_args, launch_engine_core,
                                    load_tokenizer_while_launching, made_while_launching)
from vllm_lite.engine.output_collector import (DEFAULT_MAX_UNREAD_OUTPUTS, ConsumerStoppedReadingError,
                                               RequestOutputCollector)
from vllm_lite.engine.stats import IterationStats, StatLogger
from vllm_lite.engine.stats_log import StatsLog, log_stats_interval
from vllm_lite.engine.output_processor import OutputProcessor, RequestState
from vllm_lite.engine.parallel_sampling import fan_out
from vllm_lite.engine.profiling import ProfileSessions, frontend_trace_name
from vllm_lite.wire import EngineCoreOutputs, RequestError, split_token_columns
from vllm_lite.lora.request import LoRARequest
from vllm_lite.outputs import EmbeddingRequestOutput, RequestOutput
from vllm_lite.pooling_params import PoolingParams
from vllm_lite.rpc import make_call
from vllm_lite.sampling_params import SamplingParams

# Requests whose outputs are processed between two yields to the event loop (vLLM's default).
DEFAULT_OUTPUT_CHUNK_SIZE = 128

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, vllm_config: VllmConfig, engine_address: str | None = None,
                 max_unread_outputs: int = DEFAULT_MAX_UNREAD_OUTPUTS,
                 output_chunk_size: int = DEFAULT_OUTPUT_CHUNK_SIZE, log_stats: bool = False,
                 **client_kwargs: Any) -> None:
        """`log_stats`: vLLM's; keep the counts of the periodic stats line, which `do_log_stats()`
        writes (from_engine_args sets it unless disable_log_stats=True, vLLM's default)."""
        if max_unread_outputs < 1:
            raise ValueError(f"max_unread_outputs must be >= 1, got {max_unread_outputs}")
        if output_chunk_size < 1:
            raise ValueError(f"output_chunk_size must be >= 1, got {output_chunk_size}")
        if vllm_config.parallel_config.distributed_executor_backend == "external_launcher":
            raise ValueError("distributed_executor_backend='external_launcher' is for LLM in the processes torchrun "
                             "starts (vLLM's offline use); AsyncLLM and the server take 'mp'")
        self.vllm_config = vllm_config
        self.max_unread_outputs = max_unread_outputs
        self.output_chunk_size = output_chunk_size
        data_parallel = vllm_config.parallel_config.data_parallel_size > 1
        if data_parallel and engine_address is not None:
            raise ValueError("data_parallel_size > 1 starts its own engine cores; it does not attach to engine_address")
        if data_parallel:
            launch = launch_engine_cores(vllm_config)
        else:
            launch = launch_engine_core(vllm_config) if engine_address is None else None
        self.tokenizer = load_tokenizer_while_launching(vllm_config, launch)
        self.input_processor = made_while_launching(launch, lambda: InputProcessor(
            vllm_config.model_config, self.tokenizer, vllm_config.lora_config))
        self.output_processor = OutputProcessor(self.tokenizer, vllm_config.scheduler_config.stream_interval)
        self.engine_core = (DPAsyncClient(vllm_config, launch, **client_kwargs) if data_parallel
                            else AsyncMPClient(vllm_config, engine_address, launch=launch, **client_kwargs))
        # The KV cache's size is the engine core's (measured there under gpu_memory_utilization).
        self.vllm_config = vllm_config.with_num_kv_blocks(self.engine_core.num_kv_blocks)
        self.profile_sessions = ProfileSessions(vllm_config.profiler_config)
        self._frontend_profiler: Any = None  # (worker.profiler.TorchProfiler, made by the first start_profile)
        self._output_handler: asyncio.Task | None = None
        self._handler_error: EngineDeadError | None = None  # the output handler failed
        # Called with each step's IterationStats (the server's Prometheus metrics); while the
        # list is empty no stats are collected.
        self.stat_loggers: list[StatLogger] = []
        # Called with the limit of each request refused at admission (vllm:admission_rejections)
        self.admission_loggers: list[Callable[[str], None]] = []
        self.log_stats = log_stats
        self._stats_log = StatsLog(log_stats_interval()) if log_stats else None
        if self._stats_log is not None:
            self.stat_loggers.append(self._stats_log.record_iteration)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **client_kwargs: Any) -> AsyncLLM:
        """Spawn an engine core for `engine_args` and serve it."""
        return cls(engine_args.create_engine_config(), log_stats=engine_args.disable_log_stats is not True,
                   **client_kwargs)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, disable_log_stats: bool = False,
                         **client_kwargs: Any) -> AsyncLLM:
        """vLLM's: spawn an engine core for an engine config already made (`create_engine_config`)."""
        return cls(vllm_config, log_stats=not disable_log_stats, **client_kwargs)

    @classmethod
    def connect(cls, address: str, model: str | None = None, **engine_args: Any) -> AsyncLLM:
        """Attach to an engine core started on its own (`vllm-lite engine --address ...`). The
        model, tokenizer and max_model_len left out are the engine's. Client options
        (heartbeat_interval_s, heartbeat_timeout_s) may be passed too."""
        client_kwargs = {k: engine_args.pop(k) for k in ("heartbeat_interval_s", "heartbeat_timeout_s")
                         if k in engine_args}
        args = attached_engine_args(address, model, engine_args)
        return cls(args.create_engine_config(), engine_address=address, log_stats=args.disable_log_stats is not True,
                   **client_kwargs)

    @property
    def errored(self) -> bool:
        """True once this engine can serve no more requests (as vLLM's AsyncLLM.errored)."""
        return self._handler_error is not None or self.engine_core.is_engine_dead

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine can take requests (neither errored nor shut down)."""
        return not (self.errored or self.engine_core.state.shutting_down)

    @property
    def is_stopped(self) -> bool:
        """vLLM's: the engine can take no more requests (errored or shut down)."""
        return not self.is_running

    @property
    def dead_error(self) -> EngineDeadError:
        """What later calls raise once `errored` (as vLLM's AsyncLLM.dead_error)."""
        if self._handler_error is not None:
            return self._handler_error
        return EngineDeadError(self.engine_core.state.dead_reason or "the engine core died")

    # ---- requests ----
    def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                 request_id: str, priority: int = 0, *,
                 lora_request: LoRARequest | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (as `sampling_params.output_kind` says) until it
        finishes; the request is added when the stream is first read. Raises EngineDeadError if
        the engine core dies, RequestRejectedError (a ValueError) if it refuses the request.
        `lora_request`: the LoRA adapter it runs with (vLLM's)."""
        return self._outputs(lambda: self.add_request(request_id, prompt, sampling_params, priority, lora_request),
                             request_id)

    def encode(self, prompt: PromptType, pooling_params: PoolingParams | None,
               request_id: str, priority: int = 0, *,
               lora_request: LoRARequest | None = None) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """An embedding model's vector for the prompt (the pooling runner; vLLM's AsyncLLM.encode):
        one output, when the prompt is computed."""
        return self._outputs(lambda: self._add_pooling_request(request_id, prompt, pooling_params, priority,
                                                               lora_request), request_id)

    async def _add_pooling_request(self, request_id: str, prompt: PromptType, pooling_params: PoolingParams | None,
                                   priority: int, lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        if self.errored:
            raise self.dead_error
        self.check_admission()
        self._start_output_handler()
        text, token_ids, request, pooling = self.input_processor.process_pooling(request_id, prompt, pooling_params,
                                                                                priority, lora_request)
        queue = RequestOutputCollector(request.sampling_params.output_kind, self.max_unread_outputs)
        self.output_processor.add_request(request_id, text, token_ids, request.sampling_params, queue=queue,
                                          pooling=pooling)
        try:
            await self.engine_core.add_request_async(request)
        except BaseException:
            self._abort_now([request_id])
            raise
        return queue

    async def _outputs(self, add: Callable[[], Awaitable[RequestOutputCollector]],
                       request_id: str) -> AsyncGenerator[Any, None]:
        """Adds the request (`add`, awaited on the first read), then its outputs from its
        collector until it finishes; aborted if the consumer leaves before. One generator from
        the collector to the caller: every layer is paid on each streamed token."""
        queue = await add()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    finished = True  # nothing left to abort
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_now([request_id])

    def check_admission(self, n: int = 1) -> None:
        """vLLM's admission limits: refuse (AdmissionRejectedError, a 503) a request whose `n`
        sequences would pass max_num_queued_reqs, or any while the prompt tokens of requests not
        past their prefill reach max_num_queued_tokens (counted whole, as vLLM counts them)."""
        scheduler = self.vllm_config.scheduler_config
        limit = None
        if scheduler.max_num_queued_reqs is not None and \
                len(self.output_processor.request_states) + n > scheduler.max_num_queued_reqs:
            limit = "max_num_queued_reqs"
        elif scheduler.max_num_queued_tokens is not None and \
                self.output_processor.num_prefill_tokens() >= scheduler.max_num_queued_tokens:
            limit = "max_num_queued_tokens"
        if limit is not None:
            for logger_ in self.admission_loggers:
                logger_(limit)
            raise AdmissionRejectedError(limit)

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                          lora_request: LoRARequest | None = None) -> RequestOutputCollector:
        """Send the request (n > 1 fans out); its outputs arrive in the returned collector."""
        if self.errored:
            raise self.dead_error
        self.check_admission(params.n)
        self._start_output_handler()
        images, uuids, kwargs = self.input_processor.images(prompt)  # (resizing images takes milliseconds: off the loop)
        processed = (await asyncio.to_thread(self.input_processor.process_images, images, uuids, kwargs)
                     if images else [])
        text, token_ids, request = self.input_processor.process_prompt(request_id, prompt, params, priority,
                                                                      lora_request, processed)
        queue = RequestOutputCollector(params.output_kind, self.max_unread_outputs)
        added = []
        try:
            for child, parent, index in fan_out(request):
                self.output_processor.add_request(child.request_id, text, token_ids, child.sampling_params,
                                                  queue=queue, parent=parent, index=index, lora_request=lora_request,
                                                  prompt_is_embeds=request.prompt_embeds is not None)
                added.append(child.request_id)
                await self.engine_core.add_request_async(child)
        except BaseException:
            self._abort_now(added)
            raise
        return queue

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests; each one's generator gets a last output with finish_reason 'abort'."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for state in self._abort_now(request_ids):
            output = state.make_output()
            if output is None and state.pooling is not None:  # an embedding request: no vector to give
                output = RequestAbortedError(state.request_id)
            if output is not None and state.queue is not None:
                state.queue.put_nowait(output)

    def unfinished_request_ids(self) -> list[str]:
        """The requests in flight (n > 1: each sample's own id)."""
        return list(self.output_processor.request_states)

    def _abort_now(self, request_ids: list[str]) -> list[RequestState]:
        aborted = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests_nowait([state.request_id for state in aborted])
        return aborted

    # ---- LoRA adapters (vLLM's) ----
    def check_lora(self, lora_request: LoRARequest) -> None:
        """The adapter read and checked as a request naming it is (VLLMValidationError if it
        cannot serve); the workers load it with the first such request."""
        self.input_processor.check_lora(lora_request)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: the adapter checked (`check_lora`) and known to the engine."""
        self.check_lora(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: the id may name another adapter folder from now on."""
        return self.forget_lora(lora_id)

    def forget_lora(self, lora_id: int) -> bool:
        """`remove_lora` without awaiting (the server's unload route calls it)."""
        return self.input_processor.forget_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return self.input_processor.lora_ids()

    # ---- engine-wide calls ----
    async def get_stats(self) -> dict[str, Any]:
        return {**await self.engine_core.get_stats_async(), **self.input_processor.mm_cache_stats()}

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    # ---- vLLM's pause and sleep (an RL trainer's weight updates) ----
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's: requests added from now wait until `resume_generation`. `mode`: "abort" ends
        the requests in flight (finish_reason abort), "wait" returns once they have finished,
        "keep" freezes them until resumed. `clear_cache`: the prefix cache is forgotten once
        nothing runs (not with "keep")."""
        check_pause_mode(mode)
        await self.engine_core.pause_async(mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.engine_core.resume_async()

    async def is_paused(self) -> bool:
        return await self.engine_core.is_paused_async()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's (`LLM.sleep`): level 0 pauses; level 1 on CPU also releases the KV cache."""
        check_sleep(level, mode, self.vllm_config.device_config.device)
        await self.engine_core.sleep_async(level, mode)

    async def release_kv_cache_memory(self) -> None:
        """vLLM's: after a completed pause (sleep level 0, nothing left running), the KV cache's
        memory is released; `wake_up(["kv_cache"])` brings it back."""
        await self.engine_core.release_kv_cache_memory_async()

    async def update_weight_version(self, new_version: str) -> None:
        """vLLM's: the label of the engine's weights from its next step on; each finished
        output's `weight_versions` says which label sampled which of its tokens."""
        await self.engine_core.set_weight_version_async(new_version)

    async def get_weight_version(self) -> str:
        return await self.engine_core.get_weight_version_async()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        check_wake_up_tags(tags)
        return await self.engine_core.wake_up_async(tags)

    async def is_sleeping(self) -> bool:
        return await self.engine_core.is_sleeping_async()

    def expanded_image_prompt(self, token_ids: list[int], images: list[Any], uuids: list[str | None],
                              kwargs: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids with each image's placeholder expanded (the server's chat checks
        the expanded length before it adds the request; `kwargs`: its mm_processor_kwargs)."""
        return self.input_processor.expanded_image_prompt(token_ids, images, uuids, kwargs)

    async def reset_mm_cache(self) -> None:
        """vLLM's: forget the processed images kept by their content (mm_processor_cache_gb)."""
        self.input_processor.reset_mm_cache()

    async def reset_encoder_cache(self) -> None:
        """vLLM's: every worker forgets the image features it keeps for reuse."""
        await self.collective_rpc("reset_encoder_cache")

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: `method` on every worker between engine steps (`LLM.collective_rpc`)."""
        return await self.engine_core.collective_rpc_async(make_call(method, args, kwargs), timeout)

    async def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                            max_iterations: int | None = None) -> None:
        """vLLM's: every rank's torch profiler records from now (profiler_config), and, unless
        ignore_frontend, this process's own (`[<prefix>_]<host>_<pid>.async_llm`)."""
        self.profile_sessions.begin(profile_prefix, delay_iterations, max_iterations)
        try:
            await self.engine_core.profile_async(True, profile_prefix, delay_iterations, max_iterations)
        except BaseException:
            self.profile_sessions.failed()
            raise
        config = self.vllm_config.profiler_config
        if config.profiles_frontend:
            from vllm_lite.worker.profiler import TorchProfiler

            if self._frontend_profiler is None:
                self._frontend_profiler = TorchProfiler(config, "cpu", frontend_trace_name(profile_prefix))
            self._frontend_profiler.set_name(frontend_trace_name(profile_prefix))
            # (on the event loop's thread, where this process's work runs: the torch profiler
            # records the thread that starts it, and must be stopped there)
            self._frontend_profiler.start()

    async def stop_profile(self) -> None:
        """vLLM's: the ranks (and this process) stop recording and write their traces."""
        self.profile_sessions.end()
        await self.engine_core.profile_async(False)
        if self._frontend_profiler is not None:
            self._frontend_profiler.stop()

    async def do_log_stats(self) -> None:
        """vLLM's: write the stats line for the time since the last one (vLLM's server calls it
        every VLLM_LOG_STATS_INTERVAL seconds); nothing when the stats are off (log_stats False)."""
        if self._stats_log is not None:
            self._stats_log.log(await self.get_stats())

    async def check_health(self) -> None:
        """Raises EngineDeadError unless the engine core answers."""
        if self._handler_error is not None:
            raise self._handler_error
        if not await self.engine_core.is_healthy_async():
            raise EngineDeadError("the engine core reports itself unhealthy")

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the requests this client has added that have not finished."""
        return len(self.output_processor.request_states)

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the model serves, ("generate",) or, for an embedding model, ("embed",)."""
        return ("embed",) if self.vllm_config.model_config.pooler is not None else ("generate",)

    def shutdown(self) -> None:
        """Stop the output handler and the engine core this AsyncLLM spawned (an attached engine
        keeps running). Pending generators raise EngineDeadError."""
        if self._output_handler is not None and not self._output_handler.get_loop().is_closed():
            self._output_handler.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine_core.shutdown()

    # ---- the output handler ----
    def _start_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="async-llm-output-handler")

    async def _run_output_handler(self) -> None:
        """Any failure here ends this engine: every waiting request gets the error at once, and
        so does every later call (`errored`, `dead_error`), instead of waiting forever."""
        try:
            while True:
                message = await self.engine_core.get_output_async()
                if isinstance(message, RequestError):
                    self._reject(message)
                else:
                    await self._process_outputs(message)
                await asyncio.sleep(0)  # consumers take this step's outputs before the next one's
        except EngineDeadError as exc:
            self._fail_all(exc)
        except Exception as exc:
            logger.exception("AsyncLLM: the output handler failed")
            self._handler_error = EngineDeadError(f"the output handler failed: {type(exc).__name__}: {exc}")
            self._fail_all(self._handler_error)

    async def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        """One step's outputs, `output_chunk_size` rows at a time with a yield between chunks.
        A request aborted meanwhile is simply not found by the later chunk. A step whose rows
        took several tokens (speculative decoding) as that many steps of one."""
        iteration_stats = IterationStats(outputs.engine_index) if self.stat_loggers else None
        for part in split_token_columns(outputs):
            await self._process_step(part, iteration_stats)
        if iteration_stats is not None:
            for stat_logger in self.stat_loggers:
                stat_logger(iteration_stats)

    async def _process_step(self, outputs: EngineCoreOutputs, iteration_stats: IterationStats | None) -> None:
        processor = self.output_processor
        processor.begin_step(outputs, iteration_stats)
        num_rows = len(outputs.req_ids)
        for start in range(0, num_rows, self.output_chunk_size):
            if start:
                await asyncio.sleep(0)
            states, stopped_by_string = processor.process_rows(outputs, start, start + self.output_chunk_size,
                                                               iteration_stats)
            self._hand_out(states)
            if stopped_by_string:
                self.engine_core.abort_requests_nowait(stopped_by_string)
        self._hand_out(processor.end_step(outputs, iteration_stats))

    def _hand_out(self, states: list[RequestState]) -> None:
        stopped_reading: list[RequestState] = []
        for state in states:
            output = state.make_output()
            if output is not None and not state.queue.put(output):
                stopped_reading.append(state)
        if stopped_reading:
            self._abort_unread(stopped_reading)

    def _abort_unread(self, states: list[RequestState]) -> None:
        """Requests whose consumers stopped reading: aborted (n > 1: the whole parent), each
        consumer finds an error when it reads again."""
        request_ids = list(dict.fromkeys(state.parent.request_id if state.parent is not None
                                         else state.request_id for state in states))
        logger.warning("AsyncLLM: aborting %d request(s) whose consumers left more than %d outputs "
                       "unread", len(request_ids), self.max_unread_outputs)
        self._abort_now(request_ids)
        for state in states:
            state.queue.put(ConsumerStoppedReadingError(
                f"request {state.request_id!r} was aborted: its consumer left more than "
                f"{self.max_unread_outputs} outputs unread"))

    def _reject(self, error: RequestError) -> None:
        states = self.output_processor.abort_requests([error.request_id])
        for state in states:
            if state.parent is not None:  # n > 1: the siblings cannot finish the request alone
                self._abort_now([state.parent.request_id])
            state.queue.put_nowait(RequestRejectedError(error.request_id, error.message, error.while_running))

    def _fail_all(self, error: EngineDeadError) -> None:
        states = list(self.output_processor.request_states.values())
        self.output_processor.abort_requests([state.request_id for state in states])
        for state in states:
            state.queue.put_nowait(EngineDeadError(error.reason))


AsyncLLMEngine = AsyncLLM  # vLLM V1's other name for it
