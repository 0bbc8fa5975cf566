"""A worker owns one device: it sets the process up, holds the ModelRunner and the KV cache."""

from __future__ import annotations

import torch

from vllm_lite.config import VllmConfig
from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.worker.model_runner import ModelRunner, ModelRunnerOutput


class Worker:
    def __init__(self, vllm_config: VllmConfig, tp: TensorParallelGroup = SINGLE_RANK,
                 local_rank: int = 0) -> None:
        device_name = vllm_config.device_config.device
        if device_name == "cuda":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(vllm_config.model_config.seed)
        self.model_runner = ModelRunner(vllm_config, self.device, tp)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
