"""A stand-in for AsyncLLM with its interface and predictable outputs, so the HTTP layer can
be tested in-process in milliseconds: sample i of a request emits tokens 10 + i, 11 + i, ...
as delta outputs, one per step, each with logprobs when asked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from vllm_lite.engine.stats import IterationStats
from vllm_lite.exceptions import EngineDeadError
from vllm_lite.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_lite.sampling_params import SamplingParams


class FakeEngine:
    def __init__(self, tokenizer: Any, max_model_len: int = 64, step_delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(
            model="fake/model", max_model_len=max_model_len, hf=SimpleNamespace(vocab_size=len(tokenizer)),
            sampling_defaults={}, image_encoder=None, images_refused="a text model"))
        self.step_delay_s = step_delay_s
        self.dead = False
        self.errored = False  # AsyncLLM's: the engine is gone for good
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.encoder_cache_resets = self.mm_cache_resets = 0
        self.abort_requested: set[str] = set()
        self.params: list[SamplingParams] = []
        self.prompts: list[dict[str, Any]] = []
        self.stat_loggers: list[Any] = []  # AsyncLLM's: each output is reported as a step of its own
        self.admission_loggers: list[Any] = []  # AsyncLLM's (this engine admits every request)

    async def generate(self, prompt: dict[str, Any], params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError("the engine core died")
        if params.logprobs is not None and params.logprobs > 20:
            raise ValueError(f"SamplingParams.logprobs must be <= 20, got {params.logprobs}")
        self.params.append(params)
        self.prompts.append(prompt)
        self.running.add(request_id)
        num_steps = params.max_tokens or 8
        finished = False
        try:
            for step in range(num_steps):
                await asyncio.sleep(self.step_delay_s)
                if self.dead:
                    raise EngineDeadError("the engine core died")
                if request_id in self.abort_requested:  # AsyncLLM.abort: one last output, 'abort'
                    finished = True
                    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                               for i in range(params.n)]
                    yield RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"], outputs, True)
                    return
                finished = step == num_steps - 1
                outputs = [self._sample(i, step, finished, params) for i in range(params.n)]
                self._report_step(outputs)
                yield RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"], outputs, finished)
        finally:
            self.running.discard(request_id)
            if not finished:  # AsyncLLM's contract: a generator closed early aborts its request
                self.aborted.append(request_id)

    def _report_step(self, outputs: list[CompletionOutput]) -> None:
        """AsyncLLM hands each engine step's IterationStats to its stat loggers (the server's
        metrics count generated tokens there); here an output is a step."""
        stats = IterationStats(num_generation_tokens=sum(len(output.token_ids) for output in outputs))
        for stat_logger in self.stat_loggers:
            stat_logger(stats)

    def _sample(self, index: int, step: int, last: bool, params: SamplingParams) -> CompletionOutput:
        token_id = 10 + index + step
        logprobs = None
        if params.logprobs is not None:
            entry = {token_id: Logprob(-0.5, 2, self.tokenizer.decode([token_id]))}
            for rank in range(1, params.logprobs + 1):
                top_id = 100 + rank
                entry.setdefault(top_id, Logprob(-0.1 * rank, rank, self.tokenizer.decode([top_id])))
            logprobs = [entry]
        return CompletionOutput(index=index, text=self.tokenizer.decode([token_id]), token_ids=[token_id],
                                logprobs=logprobs, finish_reason="length" if last else None)

    async def abort(self, request_id: str | list[str]) -> None:
        request_ids = [request_id] if isinstance(request_id, str) else request_id
        self.aborted.extend(request_ids)
        self.abort_requested.update(request_ids)

    async def reset_prefix_cache(self) -> bool:
        """AsyncLLM's: False while requests hold KV blocks."""
        return not self.running

    async def reset_encoder_cache(self) -> None:
        self.encoder_cache_resets += 1

    async def reset_mm_cache(self) -> None:
        self.mm_cache_resets += 1

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("the engine core died")

    async def get_stats(self) -> dict[str, int]:
        if self.dead:
            raise EngineDeadError("the engine core died")
        return {"num_running": len(self.running), "num_waiting": 0, "num_preemptions": 0,
                "prefix_cache_queries": 10, "prefix_cache_hits": 4, "kv_blocks_total": 8,
                "kv_blocks_free": 8 - len(self.running)}

    def shutdown(self) -> None:
        pass


class ScriptedEngine(FakeEngine):
    """Every request's reply is `script`, one piece per step (a token each), ending with
    `finish_reason` (and `stop_reason`); each request's prompt is kept."""

    def __init__(self, tokenizer: Any, script: list[str], fail_after: int | None = None,
                 finish_reason: str = "stop", stop_reason: int | str | None = None, max_model_len: int = 512) -> None:
        super().__init__(tokenizer, max_model_len=max_model_len)
        self.script = script
        self.fail_after = fail_after  # raise EngineDeadError after this many pieces
        self.finish_reason, self.stop_reason = finish_reason, stop_reason

    async def generate(self, prompt: dict[str, Any], params: SamplingParams,
                       request_id: str, priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        self.params.append(params)
        for step, piece in enumerate(self.script):
            if step == self.fail_after:
                raise EngineDeadError("the engine core died")
            last = step == len(self.script) - 1
            output = CompletionOutput(index=0, text=piece, token_ids=[7], finish_reason=self.finish_reason
                                      if last else None, stop_reason=self.stop_reason if last else None)
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], [output], last)
            await asyncio.sleep(0)
