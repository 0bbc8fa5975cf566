"""The synchronous engine behind `LLM`: input processing, an engine-core client, output
processing."""

from __future__ import annotations

from typing import Any

from vllm_lite.config import EngineArgs, VllmConfig
from vllm_lite.engine.core_client import InprocClient
from vllm_lite.engine.input_processor import InputProcessor, PromptType
from vllm_lite.engine.output_processor import OutputProcessor
from vllm_lite.engine.tokenizer import load_tokenizer
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = load_tokenizer(vllm_config.model_config.tokenizer)
        self.input_processor = InputProcessor(vllm_config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = InprocClient(vllm_config)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        text, token_ids = self.input_processor.tokenize(prompt)
        request = self.input_processor.process(request_id, token_ids, params)
        self.output_processor.add_request(request_id, text, token_ids, params)
        try:
            self.engine_core.add_request(request)
        except Exception:
            self.output_processor.abort_requests([request_id])
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        states, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return [out for state in states if (out := state.make_output()) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_stats(self) -> dict[str, Any]:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
