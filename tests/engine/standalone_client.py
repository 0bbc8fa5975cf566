"""A client process for tests/engine/test_standalone_engine.py: attach to an engine core,
generate greedily for the prompts given, print one JSON list of results.

    python standalone_client.py ADDRESS sync|async PROMPTS_JSON MAX_TOKENS
"""

from __future__ import annotations

import asyncio
import json
import sys

from vllm_lite import LLM, AsyncLLM, SamplingParams
from vllm_lite.sampling_params import RequestOutputKind


def run_sync(address: str, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    llm = LLM(engine_address=address)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.outputs[0].token_ids} for o in outputs]


async def run_async(address: str, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    engine = AsyncLLM.connect(address)
    delta = params.clone_with(output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> dict:
        token_ids: list[int] = []
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, delta, f"async-client-{i}"):
            token_ids += out.outputs[0].token_ids
        return {"prompt_token_ids": prompts[i], "token_ids": token_ids}

    try:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        engine.shutdown()


def main() -> None:
    address, mode, prompts, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if mode == "sync":
        results = run_sync(address, prompts, params)
    else:
        results = asyncio.run(run_async(address, prompts, params))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
