"""Prompt logprobs with the official openai client, as vLLM returns them: `prompt_logprobs`
(completions: per choice; chat: on the response) and `echo` with `logprobs` on completions.

    vllm-lite serve /path/to/model --port 8000   # in another shell
    python examples/openai_prompt_logprobs.py http://127.0.0.1:8000
"""

import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id
    prompt = "The quick brown fox jumps over the lazy dog"

    choice = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                       extra_body={"prompt_logprobs": 2}).choices[0]
    for position, entry in enumerate(choice.prompt_logprobs):  # the first token has no prefix: None
        if entry is not None:
            best = sorted(entry.values(), key=lambda e: e["rank"])[0]
            print(position, {k: round(v["logprob"], 3) for k, v in entry.items()}, "best:", repr(best["decoded_token"]))

    # echo + logprobs: the prompt's tokens come back with their logprobs, then the completion's.
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, logprobs=1).choices[0]
    for token, logprob in zip(echoed.logprobs.tokens, echoed.logprobs.token_logprobs):
        print(f"{token!r:>12} {logprob}")

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    print("chat prompt positions with logprobs:", len(chat.model_extra["prompt_logprobs"]))


if __name__ == "__main__":
    main()
