"""`vllm-lite serve --enable-prompt-embeds`: /v1/completions takes vLLM's `prompt_embeds` (base64 of
a `torch.save`d tensor, one or a list, before the `prompt` prompts in the batch) and answers with
transformers' greedy tokens for those `inputs_embeds`, whole and streamed, through the OpenAI
client as vLLM's example sends them; a payload that cannot be a prompt is a 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from live_server import LiveServer, running_server

from hf_reference import hf_greedy, hf_greedy_from_embeds

MODEL = "embeds"
API_KEY = "sk-embeds"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WIDTH = 64
NEW_TOKENS = 10


def encoded(tensor: object) -> str:
    """vLLM's client side (its tensor2base64): torch.save, then base64."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def random_embeds(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, WIDTH, generator=generator) for n in lengths]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_llama, tmp_path_factory.mktemp("embeds") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--enable-prompt-embeds")) as live:
        yield live


def post(server: LiveServer, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        return client.post("/v1/completions", json={"model": MODEL, "max_tokens": NEW_TOKENS, "temperature": 0,
                                                    "ignore_eos": True, **body})


def test_embeds_and_token_prompts_in_one_batch(server: LiveServer, tiny_llama: Path,
                                               prompts_token_ids: list[list[int]]) -> None:
    """Choices 0 and 1 are the embeddings' (vLLM puts them first), 2 the token prompt's; usage
    counts a row of embeddings as a prompt token."""
    embeds = random_embeds(6, 25)
    tokens = prompts_token_ids[1]
    reply = post(server, {"prompt_embeds": [encoded(e) for e in embeds], "prompt": tokens,
                          "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda choice: choice["index"])
    assert [c["token_ids"] for c in choices[:2]] == hf_greedy_from_embeds(tiny_llama, embeds, NEW_TOKENS)
    assert choices[2]["token_ids"] == hf_greedy(tiny_llama, [tokens], NEW_TOKENS)[0]
    assert choices[0]["prompt_token_ids"] == [0] * 6  # (vLLM's placeholders)
    assert reply.json()["usage"]["prompt_tokens"] == 6 + 25 + len(tokens)


def test_streamed_and_through_the_openai_client(server: LiveServer, tiny_llama: Path) -> None:
    """As vLLM's example sends them: prompt "", the tensor in extra_body; bf16 rows are cast to
    the model's dtype (fp32 here: the same values)."""
    embeds = random_embeds(14, seed=1)[0].to(torch.bfloat16)
    expected = hf_greedy_from_embeds(tiny_llama, [embeds.float()], NEW_TOKENS)[0]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)
    whole = client.completions.create(model=MODEL, prompt="", max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"prompt_embeds": encoded(embeds), "ignore_eos": True,
                                                  "return_token_ids": True})
    assert whole.choices[0].token_ids == expected
    streamed: list[int] = []
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as http:
        body = {"model": MODEL, "prompt_embeds": encoded(embeds), "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        streamed.extend(chunk["choices"][0].get("token_ids") or [])
    assert streamed == expected


def test_truncate_prompt_tokens_keeps_the_last_rows(server: LiveServer, tiny_llama: Path) -> None:
    embeds = random_embeds(30, seed=2)[0]
    reply = post(server, {"prompt_embeds": encoded(embeds), "truncate_prompt_tokens": 12, "return_token_ids": True})
    assert reply.json()["choices"][0]["token_ids"] == hf_greedy_from_embeds(tiny_llama, [embeds[-12:]], NEW_TOKENS)[0]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt_embeds": "not base64!"}, "prompt_embeds", "is not base64"),
    ({"prompt_embeds": base64.b64encode(b"no tensor here").decode()}, "prompt_embeds",
     "could not be deserialized as a torch tensor"),
    # an index past the shape (to_dense would write out of bounds), refused as it is read
    ({"prompt_embeds": encoded(torch.sparse_coo_tensor(torch.tensor([[0, 100000], [0, 3]]), torch.ones(2),
                                                       (4, WIDTH), check_invariants=False))}, "prompt_embeds",
     "could not be deserialized as a torch tensor: size is inconsistent with indices"),
    ({"prompt_embeds": encoded({"rows": torch.zeros(2, WIDTH)})}, "prompt_embeds",
     "must hold one torch tensor, got dict"),
    ({"prompt_embeds": encoded(torch.zeros(3, WIDTH + 1))}, "prompt_embeds",
     f"hidden_size {WIDTH + 1} does not match the model's hidden_size {WIDTH}"),
    ({"prompt_embeds": encoded(torch.zeros(3, WIDTH, dtype=torch.int32))}, "prompt_embeds",
     "not a floating-point type"),
    ({"prompt_embeds": encoded(torch.zeros(200, WIDTH))}, "prompt_embeds", "maximum context length is 128"),
    ({"prompt_embeds": encoded(torch.zeros(3, WIDTH)), "echo": True}, "echo",
     "Echo is unsupported with prompt embeds."),
    ({"prompt_embeds": encoded(torch.zeros(3, WIDTH)), "prompt_logprobs": 1}, "prompt_logprobs",
     "prompt_logprobs is not compatible with prompt embeds."),
    ({"prompt_embeds": [], "prompt": ""}, "prompt", "Either prompt or prompt_embeds must be provided and non-empty."),
])
def test_refused_with_400_naming_the_field(server: LiveServer, body: dict, param: str, message: str) -> None:
    reply = post(server, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert post(server, {"prompt_embeds": encoded(torch.zeros(3, WIDTH))}).status_code == 200


def test_chat_embeddings_parts_are_refused_by_name(server: LiveServer) -> None:
    message = {"role": "user", "content": [{"type": "prompt_embeds", "data": encoded(torch.zeros(3, WIDTH))}]}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [message], "max_tokens": 2})
    assert reply.status_code == 400
    assert "prompt_embeds content parts" in reply.json()["error"]["message"]
