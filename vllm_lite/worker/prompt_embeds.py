"""vLLM's prompt_embeds in the worker: the prompt positions whose inputs are given embeddings
rather than token ids, spliced into the step's input embeddings."""

from __future__ import annotations

import numpy as np
import torch

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.worker.input_batch import InputBatch


class PromptEmbeds:
    """The given embeddings of the batch's requests whose prompt is not computed yet: a request
    leaves once its last prompt position is in a step (back with its NewRequestData after a
    preemption), so a step without any costs one dictionary test."""

    def __init__(self) -> None:
        self.pending: dict[str, np.ndarray] = {}

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, new: NewRequestData) -> None:
        if new.prompt_embeds is not None and new.num_computed_tokens < new.num_prompt_tokens:
            self.pending[new.req_id] = new.prompt_embeds

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def take_step(self, batch: InputBatch, rows: np.ndarray, query_starts: np.ndarray,
                  query_lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat token indices, float32 embedding rows) of the step's positions given as embeddings
        (`rows`: the step's batch rows, ascending, before their computed counts advance); None
        when it has none. Requests whose prompt this step completes leave."""
        indices, pieces = [], []
        for req_id, embeds in list(self.pending.items()):
            row = batch.req_id_to_index.get(req_id)
            k = int(np.searchsorted(rows, row)) if row is not None else len(rows)
            if k == len(rows) or rows[k] != row:
                continue  # not in this step
            start = int(batch.num_computed_tokens[row])
            end = min(start + int(query_lens[k]), len(embeds))
            if start < end:
                indices.append(np.arange(end - start) + int(query_starts[k]))
                pieces.append(embeds[start:end])
            if end >= len(embeds):
                del self.pending[req_id]
        if not indices:
            return None
        return torch.from_numpy(np.concatenate(indices)), torch.from_numpy(np.concatenate(pieces))
