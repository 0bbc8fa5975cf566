"""Image features kept by image hash across requests (vLLM's encoder cache): the same image in
another request, or in the same request after a preemption, is not run through the vision
encoder again."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from vllm_lite.wire import ImageInputs

# (images, indices of those to encode) -> each one's features [tokens, width]
EncodeImages = Callable[[ImageInputs, np.ndarray], list[torch.Tensor]]


class EncoderCache:
    """The features of recently seen images, least recently used dropped first, at most
    `max_tokens` feature rows in all (an image with more is encoded and not kept). A hash covers
    the pixel values and the image's size, which with the vision weights decide the features:
    `clear()` when the weights change."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def features(self, images: ImageInputs, which: np.ndarray, encode: EncodeImages) -> list[torch.Tensor]:
        """Each named image's features, from the cache where kept; the others encoded in one call."""
        keys = [images.hashes[i] for i in which.tolist()]
        found = [self._get(key) for key in keys]
        missing = [k for k, features in enumerate(found) if features is None]
        self.hits += len(found) - len(missing)
        self.misses += len(missing)
        if missing:
            for k, features in zip(missing, encode(images, which[missing])):
                found[k] = features
                self._put(keys[k], features)
        return found

    def clear(self) -> None:
        self.entries.clear()
        self.num_tokens = 0

    def _get(self, key: bytes) -> torch.Tensor | None:
        features = self.entries.get(key)
        if features is not None:
            self.entries.move_to_end(key)
        return features

    def _put(self, key: bytes, features: torch.Tensor) -> None:
        if len(features) > self.max_tokens or key in self.entries:
            return
        while self.num_tokens + len(features) > self.max_tokens:
            _, dropped = self.entries.popitem(last=False)
            self.num_tokens -= len(dropped)
        if features.untyped_storage().nbytes() > features.nbytes:  # (a view of the batch's output would keep it all)
            features = features.clone()
        self.entries[key] = features
        self.num_tokens += len(features)
