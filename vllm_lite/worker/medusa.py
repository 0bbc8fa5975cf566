"""vLLM's Medusa speculative decoding (method "medusa"), on the worker: the Medusa head
(model/models/medusa.py) drafts a request's next k tokens at once from the model's last hidden
state at the position before its last known token (the one that gave that token), kept per
request once each step is finished, as an EAGLE head's outputs are (worker/eagle.py). The head
has no KV cache: it reads that one state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vllm_lite.config import SpeculativeConfig
from vllm_lite.distributed.parallel_state import TensorParallelGroup
from vllm_lite.host_to_device import host_to_device
from vllm_lite.model.loader import load_medusa_head
from vllm_lite.worker.eagle import PendingStates, StateReadingProposer, StepStates, place_drafts, positions_read
from vllm_lite.worker.input_batch import InputBatch


class MedusaProposer(StateReadingProposer):
    def __init__(self, spec: SpeculativeConfig, dtype: str, device: torch.device, tp: TensorParallelGroup) -> None:
        self.model = load_medusa_head(Path(spec.draft_model), spec.medusa, dtype, device, tp)
        self.device = device
        self.pending = PendingStates.empty()  # the model's hidden state before each request's last known token

    @torch.inference_mode()
    def consume(self, batch: InputBatch, step: StepStates) -> None:
        """Keeps the model's state at each step row's position before its last known token."""
        lens, up_to_last = positions_read(batch, step)
        rows = np.flatnonzero(up_to_last)
        at = host_to_device(step.query_starts[rows].astype(np.int64) + lens[rows] - 1, self.device)
        self.pending = self.pending.replaced(step.req_ids, [step.req_ids[i] for i in rows.tolist()],
                                             (step.states[at],) if len(rows) else None, self.device)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, counts: np.ndarray) -> None:
        """Each batch row's `counts[row]` drafts (heads 0..count-1), written after its known tokens."""
        drafting = self.pending.drafting_rows(batch, counts, self.device)
        if drafting is None:
            return
        rows, (hidden,) = drafting
        num_drafts = counts[rows]
        drafts = self.model.draft_tokens(hidden, int(num_drafts.max())).cpu().numpy()
        place_drafts(batch, rows, num_drafts, drafts)
