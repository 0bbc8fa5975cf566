"""vLLM's `draft_model` speculative decoding, on each rank: a smaller model with the model's
vocabulary drafts a request's next k tokens greedily, and the model verifies them in one step
(model_runner.py's draft path, as for n-gram drafts: a draft is kept while the model's own
sample equals it, so greedy outputs are the tokens of decoding without drafts).

The scheduler gives a drafting request k places after its known tokens; before the model's
forward pass, `DraftModelProposer.propose` fills them. The draft has a KV cache of its own in the
same blocks (its block table is the request's), written lazily: a request's draft KV covers the
positions its last proposal computed, cut back to what the model has kept (rejected drafts are
written over), and each proposal first catches up on the known tokens past that, in one pass
(a whole prompt at a request's first proposal), then runs k - 1 one-token passes."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend, CommonAttentionMetadata
from vllm_lite.config import ModelConfig
from vllm_lite.distributed.parallel_state import TensorParallelGroup
from vllm_lite.host_to_device import host_to_device
from vllm_lite.model.loader import load_model
from vllm_lite.ragged import segment_offsets
from vllm_lite.worker.input_batch import InputBatch


class DraftModelProposer:
    def __init__(self, draft_config: ModelConfig, backend: AttentionBackend, device: torch.device,
                 tp: TensorParallelGroup, block_size: int) -> None:
        self.model: nn.Module = load_model(draft_config, backend, device, tp)
        self.config = draft_config
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.kv_caches: list[torch.Tensor] = []
        self.computed: dict[str, int] = {}  # request -> positions whose draft KV its last proposal wrote

    def forget(self, request_ids: Iterable[str]) -> None:
        """Finished or preempted requests: their blocks are gone (a resumed one catches up again)."""
        for request_id in request_ids:
            self.computed.pop(request_id, None)

    def reset(self) -> None:
        """The KV cache was let go (sleep), the draft's with it: every request catches up again."""
        self.kv_caches = []
        self.computed.clear()

    @torch.inference_mode()
    def propose(self, batch: InputBatch, counts: np.ndarray) -> None:
        """Each batch row's `counts[row]` drafts, written after its known tokens."""
        rows = np.flatnonzero(counts)
        if not len(rows):
            return
        req_ids = [batch.req_ids[row] for row in rows.tolist()]
        known = batch.num_tokens[rows].astype(np.int64)
        target_computed = batch.num_computed_tokens[rows].astype(np.int64)
        starts = np.minimum(np.fromiter((self.computed.get(r, 0) for r in req_ids), np.int64, len(rows)),
                            target_computed)
        lens = known - starts
        token_rows = np.repeat(rows, lens)
        positions = np.repeat(starts, lens) + segment_offsets(lens)
        drafts = np.zeros((len(rows), int(counts[rows].max())), dtype=np.int64)
        drafts[:, 0] = self._next_tokens(batch, rows, lens, token_rows, positions,
                                         batch.token_ids[token_rows, positions])
        num_drafts = counts[rows]
        for i in range(1, drafts.shape[1]):
            active = np.flatnonzero(num_drafts > i)
            step_rows = rows[active]
            drafts[active, i] = self._next_tokens(batch, step_rows, np.ones(len(active), dtype=np.int64), step_rows,
                                                  known[active] - 1 + i, drafts[active, i - 1])
        for index, row in enumerate(rows.tolist()):
            k = int(num_drafts[index])
            batch.token_ids[row, known[index]:known[index] + k] = drafts[index, :k]
            self.computed[req_ids[index]] = int(known[index]) + k - 1

    def _next_tokens(self, batch: InputBatch, rows: np.ndarray, lens: np.ndarray, token_rows: np.ndarray,
                     positions: np.ndarray, input_ids: np.ndarray) -> np.ndarray:
        """The draft's greedy token after each row's last given token (the given tokens' KV written)."""
        attn_metadata, last = draft_pass_metadata(batch, rows, lens, token_rows, positions, self.backend,
                                                  self.block_size, self.device)
        hidden = self.model(host_to_device(np.asarray(input_ids, dtype=np.int64), self.device),
                            host_to_device(np.asarray(positions, dtype=np.int64), self.device), self.kv_caches,
                            attn_metadata)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).cpu().numpy()


def draft_pass_metadata(batch: InputBatch, rows: np.ndarray, lens: np.ndarray, token_rows: np.ndarray,
                        positions: np.ndarray, backend: AttentionBackend, block_size: int,
                        device: torch.device) -> tuple[object, torch.Tensor]:
    """A drafter's pass over `lens[i]` tokens of each batch row `rows[i]` (flat: `token_rows`,
    `positions`), in the requests' blocks: its attention metadata, and the index of each row's
    last token in the pass (on the device)."""
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
    query_start_loc[1:] = np.cumsum(lens)
    seq_lens = (positions[query_start_loc[1:] - 1] + 1).astype(np.int32)
    block_ids = batch.block_table.block_ids
    slot_mapping = batch.block_table.slot_mapping(token_rows, positions, block_size)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    common = CommonAttentionMetadata(
        query_start_loc=host_to_device(query_start_loc, device), seq_lens=host_to_device(seq_lens, device),
        block_table=host_to_device(np.ascontiguousarray(block_ids[rows, :max_blocks]), device),
        slot_mapping=host_to_device(slot_mapping, device), query_start_loc_np=query_start_loc, seq_lens_np=seq_lens,
        num_actual_tokens=int(query_start_loc[-1]), max_query_len=int(lens.max()), block_size=block_size)
    return backend.build(common), host_to_device(query_start_loc[1:].astype(np.int64) - 1, device)
