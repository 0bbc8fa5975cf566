"""Helpers for the multi-process engine tests: small engines, process checks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

# Quick to start: a short context and a small KV cache.
ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 256, "dtype": "float32"}


def process_gone(pid: int) -> bool:
    """True once `pid` no longer exists (not even as a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def token_prompts(prompts_token_ids: Sequence[Sequence[int]], count: int) -> list[dict[str, list[int]]]:
    """`count` distinct token prompts built from the fixture prompts."""
    return [{"prompt_token_ids": [*prompts_token_ids[i % len(prompts_token_ids)][: 3 + i % 17], 5 + i]}
            for i in range(count)]
