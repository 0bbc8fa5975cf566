"""Beam search, offline and through the server, as in vLLM: `LLM.beam_search` and the
`use_beam_search` extension (beam width = n; the n best beams are the choices).

    python examples/beam_search.py /path/to/model                          # offline
    python examples/beam_search.py /path/to/model http://127.0.0.1:8000    # and a running vllm-lite serve
"""

import sys

from vllm_lite import LLM
from vllm_lite.entrypoints.beam_search import BeamSearchParams


def offline(model: str) -> None:
    llm = LLM(model, max_model_len=512)
    try:
        outputs = llm.beam_search(["The capital of France is", "Once upon a time"],
                                  BeamSearchParams(beam_width=4, max_tokens=16, length_penalty=1.0))
        for output in outputs:
            for beam in output.sequences:
                print(f"{beam.cum_logprob:8.3f} {beam.finish_reason:6} {beam.text!r}")
            print()
    finally:
        llm.shutdown()


def served(base_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    response = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16, n=4,
                                         extra_body={"use_beam_search": True, "length_penalty": 1.0})
    for choice in response.choices:
        print(choice.index, repr(choice.text))


if __name__ == "__main__":
    offline(sys.argv[1])
    if len(sys.argv) > 2:
        served(sys.argv[2])
