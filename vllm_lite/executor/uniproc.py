from __future__ import annotations

from vllm_lite.config import VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.executor.abstract import Executor
from vllm_lite.wire import ModelRunnerOutput
from vllm_lite.worker.worker import Worker


class UniProcExecutor(Executor):
    """The single worker lives in the engine-core process (tensor_parallel_size == 1)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__(vllm_config)
        self.worker = Worker(vllm_config)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
