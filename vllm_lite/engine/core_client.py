"""Clients of the engine core. `InprocClient` runs the core in this process."""

from __future__ import annotations

from typing import Any

from vllm_lite.config import VllmConfig
from vllm_lite.engine.core import EngineCore
from vllm_lite.engine.protocol import EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.engine_core = EngineCore(vllm_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_stats(self) -> dict[str, Any]:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
