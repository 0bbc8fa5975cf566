"""Image features kept by image hash across requests (vLLM's encoder cache): the same image in
another request, or in the same request after a preemption, is not run through the vision
encoder again."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_lite.sized_lru import SizedLru
from vllm_lite.wire import ImageInputs

# (images, indices of those to encode) -> each one's features [tokens, width]
EncodeImages = Callable[[ImageInputs, np.ndarray], list[torch.Tensor]]


class EncoderCache:
    """The features of recently seen images, at most `max_tokens` feature rows in all. A hash
    covers the pixel values and the image's size, which with the vision weights decide the
    features: `clear()` when the weights change."""

    def __init__(self, max_tokens: int) -> None:
        self.kept: SizedLru[torch.Tensor] = SizedLru(max_tokens, len)
        self.hits = 0
        self.misses = 0

    def features(self, images: ImageInputs, which: np.ndarray, encode: EncodeImages) -> list[torch.Tensor]:
        """Each named image's features, from the cache where kept; the others encoded in one call."""
        keys = [images.hashes[i] for i in which.tolist()]
        found = [self.kept.get(key) for key in keys]
        missing = [k for k, features in enumerate(found) if features is None]
        self.hits += len(found) - len(missing)
        self.misses += len(missing)
        if missing:
            for k, features in zip(missing, encode(images, which[missing])):
                found[k] = features
                if features.untyped_storage().nbytes() > features.nbytes:  # (a view of the batch's output keeps it all)
                    features = features.clone()
                self.kept.put(keys[k], features)
        return found

    def clear(self) -> None:
        self.kept.clear()
