"""vLLM's scoring of text pairs with an embedding model (a bi-encoder), shared by `LLM.score` and
the server's /score and /rerank: which pairs a request's two sides make, and each pair's score,
the cosine similarity of the two embeddings."""

from __future__ import annotations

import numpy as np

from vllm_lite.exceptions import VLLMValidationError


def pair_indices(num_first: int, num_second: int, first: str = "data_1", second: str = "data_2"
                 ) -> list[tuple[int, int]]:
    """vLLM's pairing: 1 : N (the one first text against each second one) or N : N (pairwise)."""
    if num_first == 0 or num_second == 0:
        empty = first if num_first == 0 else second
        raise VLLMValidationError(f"{empty} must hold at least one text", parameter=empty)
    if num_first > 1 and num_first != num_second:
        raise VLLMValidationError(f"Input lengths must be either 1:1, 1:N or N:N (got {num_first} {first} and "
                                  f"{num_second} {second})", parameter=second)
    return [(0 if num_first == 1 else i, i) for i in range(num_second)]


def cosine_scores(first: np.ndarray, second: np.ndarray, pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's cosine similarity of rows of `first` and `second` (torch's rule: the dot
    product over the norms' product, at least 1e-8)."""
    left, right = first[[i for i, _ in pairs]], second[[j for _, j in pairs]]
    norms = np.maximum(np.linalg.norm(left, axis=1) * np.linalg.norm(right, axis=1), 1e-8)
    return ((left * right).sum(axis=1) / norms).tolist()
