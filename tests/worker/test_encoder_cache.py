"""The encoder cache's bookkeeping (worker/encoder_cache.py): least recently used images leave
first, within the token budget; an image larger than the budget is encoded and not kept; a kept
image holds its own rows, not the encoder's whole batch. The engine's use of it:
tests/test_image_inputs.py."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from vllm_lite.wire import ImageInputs
from vllm_lite.worker.encoder_cache import EncoderCache

TOKENS = [4, 4, 4, 9]  # image i has TOKENS[i] features


def _images() -> ImageInputs:
    count = len(TOKENS)
    return ImageInputs(np.zeros((count, 3, 2, 2), np.float32), np.arange(count, dtype=np.int64) * 10,
                       np.array(TOKENS, dtype=np.int64), [hashlib.sha256(bytes([i])).digest() for i in range(count)])


class Encoder:
    """Encodes images as one batch (image i's rows all i), as the vision encoder's output is; counts what it encoded."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def __call__(self, images: ImageInputs, which: np.ndarray) -> list[torch.Tensor]:
        self.encoded.extend(which.tolist())
        batch = torch.stack([torch.full((max(TOKENS), 2), float(i)) for i in which.tolist()])
        return [batch[k, :TOKENS[i]] for k, i in enumerate(which.tolist())]


def _features(cache: EncoderCache, encoder: Encoder, *which: int) -> list[float]:
    return [float(rows[0, 0]) for rows in cache.features(_images(), np.array(which, dtype=np.int64), encoder)]


def test_the_least_recently_used_image_leaves_first() -> None:
    cache, encoder = EncoderCache(max_tokens=8), Encoder()
    assert _features(cache, encoder, 0, 1) == [0.0, 1.0] and encoder.encoded == [0, 1]
    assert _features(cache, encoder, 0) == [0.0] and encoder.encoded == [0, 1]  # found: 0 now the most recent
    assert _features(cache, encoder, 2, 0) == [2.0, 0.0] and encoder.encoded == [0, 1, 2]  # 1 left for 2
    assert _features(cache, encoder, 1) == [1.0] and encoder.encoded == [0, 1, 2, 1]
    assert (cache.hits, cache.misses, cache.kept.used) == (2, 4, 8)


def test_an_image_over_the_budget_is_not_kept_and_kept_rows_are_their_own() -> None:
    cache, encoder = EncoderCache(max_tokens=8), Encoder()
    _features(cache, encoder, 3, 0)
    _features(cache, encoder, 3, 0)
    assert encoder.encoded == [3, 0, 3]
    kept = cache.kept.entries[_images().hashes[0]]
    assert kept.shape == (4, 2) and kept.untyped_storage().nbytes() == kept.nbytes
    cache.clear()
    assert (len(cache.kept.entries), cache.kept.used) == (0, 0)
