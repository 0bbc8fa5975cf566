"""Builds a persistent batch of synthetic requests and its SamplingMetadata, for sampler tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.sample.metadata import SamplingMetadata
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.input_batch import InputBatch
from vllm_lite.worker.sampling_inputs import build_sampling_metadata


def make_batch(requests: Sequence[tuple[list[int], list[int], SamplingParams]],
               max_model_len: int = 128) -> InputBatch:
    """requests: (prompt ids, output ids so far, params) per row."""
    batch = InputBatch(max(len(requests), 1), max_model_len, 4)
    for i, (prompt, output, params) in enumerate(requests):
        batch.add_request(NewRequestData(
            req_id=f"r{i}", token_ids=np.array(prompt + output, dtype=np.int32),
            num_prompt_tokens=len(prompt), sampling_params=params, block_ids=[], num_computed_tokens=0))
    return batch


def make_metadata(batch: InputBatch, stop_ids: dict[str, tuple[int, ...]] | None = None,
                  vocab_size: int | None = None) -> SamplingMetadata:
    """stop_ids (min_tokens suppression) are keyed by request id ("r<i>" for the i-th request);
    `vocab_size`: the logits' width (allowed_token_ids needs it). Seeds come from the params."""
    rows = np.arange(batch.num_reqs)
    return build_sampling_metadata(batch, rows, stop_ids or {}, torch.device("cpu"), vocab_size=vocab_size)
