"""One AsyncLLM stream read to its end, for the tests that run several at once."""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_lite import SamplingParams
from vllm_lite.sampling_params import RequestOutputKind


async def stream_to_end(engine: Any, request_id: str, prompt: list[int], max_tokens: int,
                        started: asyncio.Event | None = None, pace_s: float = 0.0) -> Any:
    """Greedy tokens of `prompt` (ignoring EOS): the last output's completion. `started` is set
    at the first output; `pace_s`: the reader waits that long after each output (so an abort
    arrives while the request runs)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)
    last = None
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        last = output
        if started is not None:
            started.set()
        if pace_s:
            await asyncio.sleep(pace_s)
    return last.outputs[0]
