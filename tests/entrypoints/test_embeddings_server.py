"""POST /v1/embeddings on a served embedding model (`vllm-lite serve --runner pooling`), over real
HTTP: the official OpenAI client (base64 by default) and plain JSON against transformers' final
hidden states; vLLM's extra fields; what is refused, each with a 400 naming its field.
The engine side: tests/test_embeddings.py."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from live_server import LiveServer, running_server
from test_embeddings import hf_embedding

MODEL = "tiny-embed"
API_KEY = "embed-key"
PROMPT_IDS = [5, 17, 300, 41, 9, 77]


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("embed_server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--runner", "pooling", "--pooler-config",
                         '{"pooling_type": "MEAN"}')) as live:
        yield live


def _post(server: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def _error(response: httpx.Response, param: str | None) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_openai_client_embeddings_match_transformers(server: LiveServer, tiny_qwen3: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    texts = ["The river flows to the sea.", "Hello"]
    response = client.embeddings.create(model=MODEL, input=texts)  # encoding_format base64 on the wire
    tokenized = [_post(server, "/tokenize", {"prompt": text}).json()["tokens"] for text in texts]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, tokenized))
    for item, ids in zip(response.data, tokenized, strict=True):
        torch.testing.assert_close(torch.tensor(item.embedding), hf_embedding(tiny_qwen3, ids, "MEAN"),
                                   atol=2e-5, rtol=1e-4)


def test_formats_and_vllm_fields(server: LiveServer, tiny_qwen3: Path) -> None:
    expected = hf_embedding(tiny_qwen3, PROMPT_IDS, "MEAN", normalize=False)
    plain = _post(server, "/v1/embeddings", {"input": [PROMPT_IDS], "encoding_format": "float",
                                             "use_activation": False})
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["object"] == "list" and body["id"].startswith("embd-") and body["model"] == MODEL
    assert body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), expected, atol=2e-5, rtol=1e-4)
    floats = np.array(body["data"][0]["embedding"], dtype=np.float32)
    for dtype, order in (("float16", "little"), ("bfloat16", "big"), ("float32", "native")):
        reply = _post(server, "/v1/embeddings", {"input": PROMPT_IDS, "encoding_format": "base64", "use_activation":
                                                 False, "embed_dtype": dtype, "endianness": order})
        raw = base64.b64decode(reply.json()["data"][0]["embedding"])
        swap = ">" if order == "big" else "<" if order == "little" else "="
        if dtype == "bfloat16":
            bits = np.frombuffer(raw, dtype=f"{swap}u2").astype(np.uint32) << 16
            decoded = bits.view(np.float32)
        else:
            decoded = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder(swap)).astype(np.float32)
        np.testing.assert_allclose(decoded, floats, rtol=1e-2, atol=1e-2)
    named = _post(server, "/v1/embeddings", {"input": "x", "request_id": "mine"})
    assert named.json()["id"] == "embd-mine"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "x", "dimensions": 8}, "dimensions", "does not support Matryoshka embeddings"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "Input should be 'float' or 'base64'"),
    ({"messages": [{"role": "user", "content": "x"}], "input": "x"}, "messages", "vLLM's messages is not supported"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": [[1, 2], [10**9]]}, "input", "out of vocabulary"),
    ({"input": "x", "priority": 3}, "priority", "priority"),
])
def test_bad_requests_are_refused_by_field(server: LiveServer, body: dict, param: str, message: str) -> None:
    assert message in _error(_post(server, "/v1/embeddings", body), param)


def test_an_embedding_server_does_not_generate(server: LiveServer) -> None:
    reply = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert "runs an embedding model (runner='pooling')" in _error(reply, None)
    assert _post(server, "/v1/embeddings", {"input": "still serving"}).status_code == 200
