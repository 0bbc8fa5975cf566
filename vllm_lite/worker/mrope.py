"""Qwen2-VL's multimodal rotary positions (M-RoPE) of the requests that carry images.

A text token's three positions (temporal, height, width) are equal: its place in the sequence,
shifted back after each image by what the image saved (an image of h x w merged patches takes
h x w tokens but advances the positions by max(h, w)). An image's placeholders take the position
where the image starts in all three, plus their row (height) and column (width) in its grid, as
transformers' Qwen2VLModel.get_rope_index lays them out. vLLM keeps the same per request: the
prompt's positions and the shift ("mrope_position_delta") of every token after the prompt.

A step without such a request costs one dictionary test; a request without images is not kept."""

from __future__ import annotations

import numpy as np

from vllm_lite.core.scheduler_output import NewRequestData
from vllm_lite.wire import ImageInputs
from vllm_lite.worker.input_batch import InputBatch


class MropePositions:
    def __init__(self, spatial_merge: int) -> None:
        self.spatial_merge = spatial_merge
        # request id -> (its prompt's positions [3, prompt length], the shift of every later token)
        self.requests: dict[str, tuple[np.ndarray, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.requests)

    def add(self, new: NewRequestData) -> None:
        if new.images is not None:
            self.requests[new.req_id] = prompt_positions(new.num_prompt_tokens, new.images, self.spatial_merge)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def step_positions(self, batch: InputBatch, rows: np.ndarray, query_starts: np.ndarray,
                       query_lens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The step's rotary positions: `positions` (each token's place in its sequence) where no
        kept request has tokens; [3, tokens] where a prompt's image placeholders are in the step,
        else [tokens] shifted (every token's three positions equal)."""
        shifted: np.ndarray | None = None
        in_prompts: list[tuple[int, np.ndarray]] = []  # (first flat token, its prompt positions [3, n])
        for _, (prompt, shift), k, start, end in batch.in_step(rows, query_lens, self.requests):
            first, in_prompt = int(query_starts[k]), max(0, min(end, prompt.shape[1]) - start)
            if shifted is None:
                shifted = positions.astype(np.int64, copy=True)
            shifted[first + in_prompt:first + end - start] += shift
            if in_prompt:
                in_prompts.append((first, prompt[:, start:start + in_prompt]))
        if shifted is None:
            return positions
        if not in_prompts:
            return shifted
        three = np.tile(shifted, (3, 1))
        for first, part in in_prompts:
            three[:, first:first + part.shape[1]] = part
        return three


def prompt_positions(prompt_length: int, images: ImageInputs, spatial_merge: int) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions [3, prompt_length] and the shift of the tokens after it (each
    image of images.patch_grids (rows, columns) patches, placed at images.offsets)."""
    positions = np.tile(np.arange(prompt_length, dtype=np.int64), (3, 1))
    shift = 0
    for offset, length, (rows, columns) in zip(images.offsets.tolist(), images.lengths.tolist(),
                                               images.patch_grids.tolist()):
        high, wide = rows // spatial_merge, columns // spatial_merge
        start, end, saved = offset + shift, offset + length, length - max(high, wide)
        positions[0, offset:end] = start
        positions[1, offset:end] = start + np.repeat(np.arange(high), wide)
        positions[2, offset:end] = start + np.tile(np.arange(wide), high)
        positions[:, end:] -= saved
        shift -= saved
    return positions, shift
