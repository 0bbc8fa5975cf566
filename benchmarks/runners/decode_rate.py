"""The single-stream decode rate both GGUF decode runners report (stdlib only: each runner runs in
its own engine's environment). Decode tokens/s = (N - 1) / (time for N tokens - time for 1 token),
so prefill and the first token are left out; one value per repeat, after one warm-up."""

from __future__ import annotations

from collections.abc import Callable

# generate(prompt, max_tokens) -> (seconds, token ids)
Generate = Callable[[list[int], int], tuple[float, list[int]]]


def decode_rates(generate: Generate, prompt: list[int], max_tokens: int,
                 repeats: int) -> tuple[list[float], list[int]]:
    """Per-repeat decode tokens/s and the last run's output tokens."""
    generate(prompt, 4)  # warm-up
    rates: list[float] = []
    outputs: list[int] = []
    for _ in range(repeats):
        one, _ = generate(prompt, 1)
        many, outputs = generate(prompt, max_tokens)
        rates.append((max_tokens - 1) / (many - one))
    return rates, outputs
