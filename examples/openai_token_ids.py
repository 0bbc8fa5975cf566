"""vLLM's token-id extensions with the official openai client (vllm-lite serve speaks them too):
token ids out (`return_token_ids`), token ids in (a prompt of ids), logprob tokens as ids
(`return_tokens_as_token_ids`), the logprobs of chosen ids (`logprob_token_ids`, e.g. to score
labels) and prompt truncation (`truncate_prompt_tokens`).

    vllm-lite serve /path/to/model --port 8000   # in another shell
    python examples/openai_token_ids.py http://127.0.0.1:8000
"""

import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    model = client.models.list().data[0].id

    first = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                      temperature=0.0, extra_body={"return_token_ids": True}).choices[0]
    print("prompt ids ->", first.prompt_token_ids)
    print("output ids ->", first.token_ids, repr(first.text))

    # The same ids back in: a prompt of token ids is not re-tokenized.
    again = client.completions.create(model=model, prompt=first.prompt_token_ids + first.token_ids, max_tokens=8,
                                      temperature=0.0, logprobs=2,
                                      extra_body={"return_tokens_as_token_ids": True}).choices[0]
    print("logprob tokens as ids ->", again.logprobs.tokens)

    # Score two candidate first tokens: each position lists the sampled token, then exactly these ids.
    labels = first.token_ids[:1] + first.prompt_token_ids[:1]
    scored = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=1, logprobs=True,
        extra_body={"logprob_token_ids": labels, "return_tokens_as_token_ids": True})
    print("label logprobs ->", {e.token: round(e.logprob, 3) for e in scored.choices[0].logprobs.content[0].top_logprobs})

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A very long question " * 50}], max_tokens=8,
        extra_body={"truncate_prompt_tokens": 32, "return_token_ids": True})
    print("chat prompt truncated to", chat.usage.prompt_tokens, "tokens; output ids", chat.choices[0].token_ids)


if __name__ == "__main__":
    main()
