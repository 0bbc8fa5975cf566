"""Token sampling. An all-greedy batch is one argmax over the logits, with no copy."""

from __future__ import annotations

import torch

from vllm_lite.sample.metadata import SamplingMetadata


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [num_rows, vocab] -> sampled token ids int64 [num_rows]."""
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / metadata.temperature, dim=-1)
        sampled = self._random_sample(probs, metadata.generators)
        if metadata.greedy_mask is None:
            return sampled
        return torch.where(metadata.greedy_mask, logits.argmax(dim=-1), sampled)

    @staticmethod
    def _random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """Exponential-race sampling (argmax p / q, q ~ Exp(1)) equals a categorical draw and
        needs no cumulative sum; seeded rows draw q from their own generator, so their tokens
        do not depend on the rest of the batch."""
        q = torch.empty_like(probs)
        if len(generators) < probs.shape[0]:
            q.exponential_()
        for row, generator in generators.items():
            q[row].exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)
