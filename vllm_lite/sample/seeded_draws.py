"""The random draws of seeded requests, keyed by position.

A seeded row's uniform for the token at sequence position p is a hash of (its seed, p), not the
next number of a stream the request carries from step to step. The token a seeded request gets
at a position therefore depends on nothing but its seed, its tokens before it and its sampling
parameters: not on the rest of the batch, not on how its positions were grouped into steps
(a drafted step samples several; a rejected draft's draw is never "used up"), not on
preemption or the step budget. With drafts verified by sampling each position as a plain step
would (`ModelRunner._sample_drafted`), a seeded request gets the same tokens with speculative
decoding as without it. And a step costs one vectorized hash over its seeded rows, where a
generator per request cost a torch call per row (4 ms a step at 1,024 seeded rows on CPU; on
CUDA, a kernel launch per row).

The hash is SplitMix64's finalizer (Steele, Lea, Flood, "Fast splittable pseudorandom number
generators", 2014): the seed is mixed once into the row's key, each position's draw mixes the
key plus the position times the golden-ratio increment; its top 24 bits make the float32
uniform in [0, 1), the resolution of torch.rand's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_lite.host_to_device import host_to_device

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SEED_MODULUS = 2 ** 64  # seeds are 64-bit, signed or not (SamplingParams' range)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over uint64 values (multiplications wrap, as the algorithm's do)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seed_key(seed: int) -> np.uint64:
    """A request's key: its seed (any 64-bit value, negative ones included) mixed once."""
    return _mix(np.array([seed % _SEED_MODULUS], dtype=np.uint64) + _GOLDEN)[0]


def position_uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float32 uniforms in [0, 1), one per (key, sequence position) pair."""
    bits = _mix(keys + (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


@dataclass(frozen=True, slots=True)
class SeededRows:
    """The seeded random rows of a sampling batch. The metadata holding it outlives a step
    (steady decode reuses it), so the positions are read at each draw from the batch's live
    token counts: a row's token goes to position `num_tokens[batch_row] + offset` (offset j: a
    drafted step's j-th draft position)."""

    logits_rows: torch.Tensor  # int64 [m], on the sampler's device
    keys: np.ndarray  # uint64 [m]: seed_key of each row's request
    batch_rows: np.ndarray  # [m] the rows in the persistent batch
    offsets: np.ndarray  # uint64 [m]
    num_tokens: np.ndarray  # the batch's token counts (the live array, not a copy)

    def uniforms(self, device: torch.device) -> torch.Tensor:
        positions = self.num_tokens[self.batch_rows].astype(np.uint64) + self.offsets
        return host_to_device(position_uniforms(self.keys, positions), device)
