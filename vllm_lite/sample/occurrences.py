"""The token history the sampler reads (live views of the persistent batch) and the
per-request token occurrences the penalties need, kept incrementally from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.ragged import segment_offsets


@dataclass(slots=True)
class TokenHistory:
    """Live views of the persistent batch's token buffers: read at sampling time, they hold
    every token so far (`token_ids[row, :num_tokens[row]]`, the prompt first), so metadata that
    keeps them stays valid while the batch's rows stay put."""

    token_ids: np.ndarray  # int32 [max_num_reqs, max_len]
    num_prompt_tokens: np.ndarray  # int32 [max_num_reqs]
    num_tokens: np.ndarray  # int32 [max_num_reqs]
    # rows whose prompt came as embeddings: its token ids are placeholders, no prompt tokens known
    prompt_is_embeds: np.ndarray  # bool [max_num_reqs]


class TokenOccurrences:
    """Per penalized request, one row of `prompt_mask` (bool [vocab]) and `output_counts`
    (float32 [vocab]), in slots that grow by doubling.

    Invariant: `counted[slot]` tokens of the request's history (prompt first) are reflected in
    its row. A request leaves (`release`) when it finishes or is preempted; it is rebuilt from its
    history when it comes back, so preemption needs no rollback.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset(0)

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def gather(self, req_ids: list[str], batch_rows: np.ndarray, history: TokenHistory,
               vocab_size: int, repeated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Brings the requests' rows up to date with their histories and returns
        (prompt_mask [m, vocab], output_counts [m, vocab]) in the order of `req_ids`.
        `repeated`: a request may be there several times (speculative decoding's positions)."""
        if vocab_size != self.vocab_size:
            self._reset(vocab_size)
        slots = np.array([self._slot(req_id) for req_id in req_ids], dtype=np.int64)
        if repeated:  # (each request's history counted once)
            unique, first = np.unique(slots, return_index=True)
            self._catch_up(unique, batch_rows[first], history)
        else:
            self._catch_up(slots, batch_rows, history)
        if len(slots) and np.array_equal(slots, np.arange(slots[0], slots[0] + len(slots))):
            return (self.prompt_mask[slots[0]:slots[0] + len(slots)],  # views: no copy
                    self.output_counts[slots[0]:slots[0] + len(slots)])
        index = torch.from_numpy(slots).to(self.device, non_blocking=True)
        return self.prompt_mask.index_select(0, index), self.output_counts.index_select(0, index)

    def _slot(self, req_id: str) -> int:
        slot = self.slot_of.get(req_id)
        if slot is not None:
            return slot
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self.prompt_mask[slot] = False
        self.output_counts[slot] = 0.0
        self.counted[slot] = 0
        self.slot_of[req_id] = slot
        return slot

    def _catch_up(self, slots: np.ndarray, batch_rows: np.ndarray, history: TokenHistory) -> None:
        """Adds each row's tokens in [counted, num_tokens): usually one per row and step."""
        num_tokens = history.num_tokens[batch_rows].astype(np.int64)
        starts = self.counted[slots]
        lengths = num_tokens - starts
        total = int(lengths.sum())
        if total == 0:
            return
        positions = np.repeat(starts, lengths) + segment_offsets(lengths)
        token_rows = np.repeat(batch_rows, lengths)
        tokens = torch.from_numpy(history.token_ids[token_rows, positions].astype(np.int64))
        token_slots = np.repeat(slots, lengths)
        in_prompt = positions < history.num_prompt_tokens[token_rows]
        known = in_prompt & ~history.prompt_is_embeds[token_rows]
        self.prompt_mask[torch.from_numpy(token_slots[known]).to(self.device),
                         tokens[known].to(self.device)] = True
        out = ~in_prompt
        self.output_counts.index_put_(
            (torch.from_numpy(token_slots[out]).to(self.device), tokens[out].to(self.device)),
            torch.ones(int(out.sum()), device=self.device), accumulate=True)
        self.counted[slots] = num_tokens

    def _grow(self) -> None:
        old = len(self.counted)
        new = max(8, 2 * old)
        self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(new - old, self.vocab_size)])
        self.output_counts = torch.cat([self.output_counts,
                                        self.output_counts.new_zeros(new - old, self.vocab_size)])
        self.counted = np.concatenate([self.counted, np.zeros(new - old, dtype=np.int64)])
        self._free_slots.extend(range(new - 1, old - 1, -1))

    def _reset(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=self.device)
        self.counted = np.zeros(0, dtype=np.int64)
        self.slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []
