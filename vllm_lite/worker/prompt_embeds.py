"""Prompt positions whose inputs are given embeddings rather than their tokens' (vLLM's
prompt_embeds: the whole prompt; an image's features: its placeholder tokens), spliced into the
step's input embeddings."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.wire import ImageInputs
from vllm_lite.worker.input_batch import InputBatch

# (first prompt position, rows [n, width]): the inputs of positions first..first + n - 1
Segment = tuple[int, torch.Tensor]


class PromptEmbeds:
    """The given embeddings of the batch's requests whose given positions are not all computed
    yet: a request leaves once its last given position is in a step (back with its
    NewRequestData after a preemption), so a step without any costs one dictionary test."""

    def __init__(self, device: torch.device, dtype: torch.dtype, images_attend_both_ways: bool = False,
                 row_feature_pixels: int = 0) -> None:
        self.device = device
        self.dtype = dtype
        # vLLM's "mm prefix LM" (Gemma 3): an image's placeholders attend to each other both ways
        # (its segments are images only: such a model takes no prompt_embeds beside images)
        self.images_attend_both_ways = images_attend_both_ways
        # Mistral 3: the pixels on a side of one feature's square; an image's features are rows,
        # each followed by a row-end token (its own input), so each row is a segment (0: an image's
        # features fill its placeholders in one run)
        self.row_feature_pixels = row_feature_pixels
        self.pending: dict[str, list[Segment]] = {}

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, new: NewRequestData, encode_images: Callable[[ImageInputs, np.ndarray], list[torch.Tensor]]) -> None:
        """`encode_images`: (images, indices of those to encode) -> each one's features [tokens,
        width] (run only for the images whose placeholders are not all computed: not for
        prefix-cache hits)."""
        segments: list[Segment] = []
        if new.prompt_embeds is not None:
            segments.append((0, torch.from_numpy(new.prompt_embeds)))
        images = new.images
        if images is not None:
            needed = np.flatnonzero(images.offsets + images.lengths > new.num_computed_tokens)
            if len(needed):
                segments.extend(self._image_segments(images, needed, encode_images(images, needed)))
        if segments and segments[-1][0] + len(segments[-1][1]) > new.num_computed_tokens:
            self.pending[new.req_id] = segments

    def _image_segments(self, images: ImageInputs, needed: np.ndarray, features: list[torch.Tensor]) -> list[Segment]:
        offsets = images.offsets[needed].tolist()
        if not self.row_feature_pixels:
            return list(zip(offsets, features))
        segments = []
        for offset, (_, width), image in zip(offsets, images.image_sizes[needed].tolist(), features):
            columns = width // self.row_feature_pixels
            segments.extend((offset + row * (columns + 1), piece) for row, piece in enumerate(image.split(columns)))
        return segments

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def key_ends(self, batch: InputBatch, rows: np.ndarray, query_starts: np.ndarray, query_lens: np.ndarray,
                 positions: np.ndarray) -> np.ndarray | None:
        """Where images attend both ways: the keys each of the step's tokens attends (an image
        placeholder: up to its image's last; others: up to their own `positions`), for the
        attention metadata's `key_ends_np`; None when no image placeholder is in the step. Call
        before `take_step` (which lets go of the requests whose images this step completes)."""
        if not self.images_attend_both_ways:
            return None
        key_ends = None
        for _, segments, k, start, end in batch.in_step(rows, query_lens, self.pending):
            for first, embeds in segments:
                last = first + len(embeds)
                low, high = max(start, first), min(end, last)
                if low < high:
                    if key_ends is None:
                        key_ends = (positions + 1).astype(np.int32)
                    key_ends[int(query_starts[k]) + low - start:int(query_starts[k]) + high - start] = last
        return key_ends

    def take_step(self, batch: InputBatch, rows: np.ndarray, query_starts: np.ndarray,
                  query_lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat token indices, embedding rows in the model's dtype on its device) of the step's
        positions given as embeddings (`rows`: the step's batch rows, ascending, before their
        computed counts advance); None when it has none. Requests whose last given position this
        step reaches leave."""
        indices, pieces = [], []
        for req_id, segments, k, start, end in list(batch.in_step(rows, query_lens, self.pending)):
            for first, embeds in segments:
                low, high = max(start, first), min(end, first + len(embeds))
                if low < high:
                    indices.append(np.arange(low - start, high - start) + int(query_starts[k]))
                    pieces.append(embeds[low - first:high - first].to(self.device, self.dtype))
            last_first, last_embeds = segments[-1]
            if end >= last_first + len(last_embeds):
                del self.pending[req_id]
        if not indices:
            return None
        return torch.from_numpy(np.concatenate(indices)), torch.cat(pieces)
