"""Talk to `vllm-lite serve` with the official openai client.

    vllm-lite serve /path/to/model --served-model-name my-model --port 8000   # in another shell
    python examples/openai_client.py http://127.0.0.1:8000
"""

import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")  # any key unless the server has --api-key
    model = client.models.list().data[0].id

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=16,
                                           temperature=0.0)
    print("completion ->", repr(completion.choices[0].text))

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three primary colors."}], max_tokens=48,
        stream=True, stream_options={"include_usage": True},
        extra_body={"top_k": 40, "repetition_penalty": 1.1})  # vLLM's extra sampling fields
    print("chat -> ", end="")
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    main()
