"""The worker's custom logits processors (vllm_lite.logits_processor, vLLM's V1 interface): their
instances, the persistent batch's changes since the last step as vLLM's BatchUpdate, and each
request's output token list (appended to as tokens are sampled: the list a processor was handed
when the request joined stays its live view, as in vLLM).

The model runner reports the batch's changes in the order they happen (removals, joinings, the
moves that fill holes); `update_state` hands them over before each step. None of this exists
without custom processors: an engine without them builds no lists and reports nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.logits_processor import (AddedRequest, BatchUpdate, LogitsProcessor, MoveDirectionality,
                                        load_logits_processors)
from vllm_lite.sample.custom_logits import CustomLogitsStep


class CustomLogitsProcessors:
    def __init__(self, names: tuple[str, ...], vllm_config: Any, device: torch.device) -> None:
        self.processors: list[LogitsProcessor] = [cls(vllm_config, device, False)
                                                  for cls in load_logits_processors(names)]
        self.non_argmax_invariant = [p for p in self.processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]
        self.outputs: dict[str, list[int]] = {}  # request -> its output tokens (the processors' lists)
        self._removed: list[int] = []
        self._added: list[AddedRequest] = []
        self._moved: list[tuple[int, int, MoveDirectionality]] = []

    # ---- the batch's changes, as they happen (vLLM's BatchUpdateBuilder rules: `removed` keeps
    # only the rows left empty, a row a joining or a move fills is no removal) ----
    def removed(self, row: int, req_id: str) -> None:
        self.outputs.pop(req_id, None)
        joined_now = [i for i, added in enumerate(self._added) if added[0] == row]
        if joined_now:  # it joined in this same update: the processors never see it
            del self._added[joined_now[-1]]
        self._removed.append(row)

    def added(self, row: int, new: NewRequestData) -> None:
        prompt = new.token_ids[:new.num_prompt_tokens].tolist()
        outputs = new.token_ids[new.num_prompt_tokens:].tolist()  # (a request back from preemption has some)
        self.outputs[new.req_id] = outputs
        self._filled(row)
        self._added.append((row, new.sampling_params, prompt, outputs))

    def moved(self, src: int, dst: int) -> None:
        self._filled(dst)
        self._moved.append((src, dst, MoveDirectionality.UNIDIRECTIONAL))

    def _filled(self, row: int) -> None:
        if row in self._removed:
            self._removed.remove(row)

    def update_state(self, batch_size: int) -> None:
        """Before a step: every processor's update_state (None when the batch did not change)."""
        update = None
        if self._removed or self._added or self._moved:
            update = BatchUpdate(batch_size, self._removed, self._added, self._moved)
            self._removed, self._added, self._moved = [], [], []
        for processor in self.processors:
            processor.update_state(update)

    def append_sampled(self, req_ids: list[str], tokens: np.ndarray) -> None:
        """A finished step's tokens onto their requests' lists."""
        outputs = self.outputs
        for req_id, token in zip(req_ids, tokens.tolist()):
            listed = outputs.get(req_id)
            if listed is not None:
                listed.append(token)

    def for_rows(self, rows: np.ndarray, batch_size: int, device: torch.device) -> CustomLogitsStep:
        """The processors for a sampling over batch `rows` (the logits' rows, in order)."""
        every_row = len(rows) == batch_size  # (rows ascend: then they are 0 .. batch_size - 1)
        index = None if every_row else torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(device)
        return CustomLogitsStep(self.non_argmax_invariant, self.argmax_invariant, index, batch_size)
