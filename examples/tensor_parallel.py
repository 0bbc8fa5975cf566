"""Tensor parallelism: one worker process per rank (gloo on CPU, NCCL on GPUs).

    python examples/tensor_parallel.py /path/to/hf-model [tensor_parallel_size]

Every split dimension must divide: attention heads, intermediate_size, and KV heads (or the rank
count must be a multiple of them). The bundled demo model (SmolLM2-135M: 9 heads) does not split
over 2 ranks, and the engine says so up front. Multi-node launch: see the README.
"""

import sys

from vllm_lite import LLM, SamplingParams


def main() -> None:
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for output in llm.generate(["The capital of France is", "def add(a, b):"], params):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    llm.shutdown()


if __name__ == "__main__":  # required: the rank processes are spawned and import this module
    main()
