from __future__ import annotations

from abc import ABC, abstractmethod

from vllm_lite.config import VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.wire import ModelRunnerOutput


class Executor(ABC):
    """Drives the workers of one engine core."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        pass
