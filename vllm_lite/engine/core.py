"""EngineCore: scheduler + executor, one `step()` at a time."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_lite.config import VllmConfig
from vllm_lite.core.request import Request
from vllm_lite.core.scheduler import Scheduler
from vllm_lite.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from vllm_lite.executor.abstract import Executor


def make_executor(vllm_config: VllmConfig) -> Executor:
    from vllm_lite.executor.uniproc import UniProcExecutor

    return UniProcExecutor(vllm_config)


class EngineCore:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.executor = make_executor(vllm_config)
        num_blocks = vllm_config.num_kv_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(vllm_config.scheduler_config, vllm_config.cache_config, num_blocks)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> EngineCoreOutputs:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return EngineCoreOutputs([], np.zeros(0, dtype=np.int32))
        out = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, out.req_ids, out.sampled_token_ids, out.num_sampled)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> dict[str, Any]:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()

