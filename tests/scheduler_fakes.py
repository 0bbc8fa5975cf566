"""A fake worker for scheduler tests that drive `schedule()` / `update_from_output()` without a
model: it keeps each request's token count as the model runner's persistent batch does and
samples a row when all its known tokens are computed. And the marks for tests that run the
token store's loops as numpy code and, where csrc is built, in C, and prompts no two requests
share a token of."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lite.core.scheduler_output import SchedulerOutput
from vllm_lite.bookkeeping import native_loops

NEEDS_NATIVE_LOOPS = pytest.mark.skipif(native_loops is None, reason="vllm_lite._bookkeeping is not built")
EITHER_LOOPS = pytest.mark.parametrize("native", [False, pytest.param(True, marks=NEEDS_NATIVE_LOOPS)],
                                       ids=["numpy", "C"])


def distinct_prompt(request_id: str, length: int) -> np.ndarray:
    """`length` int32 tokens of a range of its own per request id: no accidental prefix hits."""
    start = 100 + 1000 * sum(map(ord, request_id))
    return np.arange(start, start + length, dtype=np.int32)


class FakeWorker:
    """Token counts per request as a worker sees them: it appends what it samples at once."""

    def __init__(self) -> None:
        self.num_tokens: dict[str, int] = {}

    def execute(self, out: SchedulerOutput, tokens: dict[str, int] | None = None, default: int = 1):
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.num_tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
        cached = out.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
        computed |= {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            ids.append(req_id)
            samples = computed[req_id] + n == self.num_tokens[req_id]
            sampled.append(samples)
            self.num_tokens[req_id] += samples
        token_ids = np.array([[(tokens or {}).get(r, default)] for r in ids], dtype=np.int32).reshape(-1, 1)
        return ids, token_ids, np.array(sampled, dtype=np.int32)
