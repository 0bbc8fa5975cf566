"""Offline batched generation with the bundled demo model (or a model folder given as argv[1])."""

import sys

from vllm_lite import LLM, SamplingParams


def main() -> None:
    llm = LLM(sys.argv[1] if len(sys.argv) > 1 else None, max_model_len=2048)
    prompts = ["The capital of France is", "The three primary colors are", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for output in llm.generate(prompts, params):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    print("chat ->", repr(chat[0].outputs[0].text))
    llm.shutdown()


if __name__ == "__main__":
    main()
