"""Stream completions with AsyncLLM: the engine core runs in its own process, and several
requests stream token by token at once. Uses the bundled demo model (or a folder in argv[1])."""

import asyncio
import sys

from vllm_lite import AsyncLLM, EngineArgs, SamplingParams
from vllm_lite.sampling_params import RequestOutputKind


async def stream(engine: AsyncLLM, prompt: str, request_id: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, output_kind=RequestOutputKind.DELTA)
    async for output in engine.generate(prompt, params, request_id):
        print(f"[{request_id}] {output.outputs[0].text!r}", flush=True)


async def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model, max_model_len=1024))
    try:
        prompts = ["The capital of France is", "Three colors of the rainbow are", "def fibonacci(n):"]
        await asyncio.gather(*(stream(engine, prompt, f"req-{i}") for i, prompt in enumerate(prompts)))
        print(await engine.get_stats())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
