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


# vLLM's default side for an embedding model is "right" (its tokenizer registry): the text's start stays.
@pytest.mark.parametrize(("side", "keep"), [(None, slice(0, 3)), ("right", slice(0, 3)), ("left", slice(-3, None))])
def test_truncate_prompt_tokens_keeps_the_side_vllm_keeps(server: LiveServer, tiny_qwen3: Path, side: str | None,
                                                          keep: slice) -> None:
    body: dict[str, Any] = {"input": [PROMPT_IDS], "encoding_format": "float", "truncate_prompt_tokens": 3}
    if side is not None:
        body["truncation_side"] = side
    reply = _post(server, "/v1/embeddings", body).json()
    assert reply["usage"]["prompt_tokens"] == 3
    torch.testing.assert_close(torch.tensor(reply["data"][0]["embedding"]),
                               hf_embedding(tiny_qwen3, PROMPT_IDS[keep], "MEAN"), atol=2e-5, rtol=1e-4)


def test_chat_style_embeddings_embed_the_rendered_conversation(server: LiveServer, tiny_qwen3: Path) -> None:
    """vLLM's chat form: `messages` (or a conversation in `input`) through the chat template
    without a generation prompt and without the tokenizer's own special tokens, one vector per
    conversation; the same vector as the rendered conversation's token ids."""
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river flows."}]
    second = [{"role": "user", "content": "Hello"}]
    rendered = [_post(server, "/tokenize", {"messages": conversation, "add_generation_prompt": False}).json()["tokens"]
                for conversation in (first, second)]
    for body in ({"messages": [first, second]}, {"input": [first, second]}):
        reply = _post(server, "/v1/embeddings", {**body, "encoding_format": "float"}).json()
        assert reply["usage"]["prompt_tokens"] == sum(map(len, rendered)), reply
        for item, ids in zip(reply["data"], rendered, strict=True):
            torch.testing.assert_close(torch.tensor(item["embedding"]), hf_embedding(tiny_qwen3, ids, "MEAN"),
                                       atol=2e-5, rtol=1e-4)
    one = _post(server, "/v1/embeddings", {"messages": first, "encoding_format": "float"}).json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(rendered[0])
    with_prompt = _post(server, "/v1/embeddings", {"messages": first, "add_generation_prompt": True}).json()
    assert with_prompt["usage"]["prompt_tokens"] > len(rendered[0])


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": "x", "dimensions": 8}, "dimensions", "does not support Matryoshka embeddings"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "Input should be 'float' or 'base64'"),
    ({"messages": [{"role": "user", "content": "x"}], "input": "x"}, "input", "either input or messages"),
    ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt", "applies to messages"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "Cannot set both"),
    ({"model": MODEL}, "input", "input (texts or token ids) or messages"),
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


# ---- vLLM's score and rerank APIs on an embedding model (cosine similarity of the embeddings) ----

def _embeddings(server: LiveServer, texts: list[str]) -> np.ndarray:
    data = _post(server, "/v1/embeddings", {"input": texts, "encoding_format": "float"}).json()["data"]
    return np.asarray([item["embedding"] for item in data], dtype=np.float64)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("route, first, second", [
    ("/score", "queries", "documents"), ("/v1/score", "text_1", "text_2"), ("/score", "data_1", "data_2"),
    ("/score", "queries", "items")])
def test_score_is_the_cosine_of_the_embeddings(server: LiveServer, route: str, first: str, second: str) -> None:
    documents = ["The river flows to the sea.", "A cat sleeps.", "Rivers and seas"]
    vectors = _embeddings(server, ["water", *documents])
    one_to_n = _post(server, route, {first: "water", second: documents}).json()
    assert [item["index"] for item in one_to_n["data"]] == [0, 1, 2] and one_to_n["object"] == "list"
    for item, vector in zip(one_to_n["data"], vectors[1:]):
        assert item["object"] == "score" and item["score"] == pytest.approx(_cosine(vectors[0], vector), abs=1e-5)
    tokens = sum(len(_post(server, "/tokenize", {"prompt": t}).json()["tokens"]) for t in ["water", *documents])
    assert one_to_n["usage"]["prompt_tokens"] == one_to_n["usage"]["total_tokens"] == tokens
    pairwise = _post(server, route, {first: documents[:2], second: documents[1:]}).json()["data"]
    assert [item["score"] for item in pairwise] == pytest.approx(
        [_cosine(vectors[1], vectors[2]), _cosine(vectors[2], vectors[3])], abs=1e-5)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score(server: LiveServer, route: str) -> None:
    documents = ["The river flows to the sea.", "A cat sleeps.", "Rivers and seas", "water water"]
    scores = [item["score"] for item in _post(server, "/score", {"queries": "water", "documents": documents})
              .json()["data"]]
    reply = _post(server, route, {"query": "water", "documents": documents, "top_n": 2}).json()
    order = sorted(range(4), key=lambda i: scores[i], reverse=True)[:2]
    assert [result["index"] for result in reply["results"]] == order
    assert [result["document"]["text"] for result in reply["results"]] == [documents[i] for i in order]
    assert [result["relevance_score"] for result in reply["results"]] == pytest.approx([scores[i] for i in order])
    assert reply["id"].startswith("rerank-") and reply["usage"]["prompt_tokens"] > 0
    assert len(_post(server, route, {"query": "water", "documents": documents}).json()["results"]) == 4


@pytest.mark.parametrize("route, body, param, message", [
    ("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "documents", "either 1:1, 1:N or N:N"),
    ("/score", {"queries": "a", "documents": []}, "documents", "at least one text"),
    ("/score", {"queries": "a"}, "queries", "one pair of fields"),
    ("/score", {"queries": "a", "documents": "b", "text_2": "c"}, "queries", "one pair of fields"),
    ("/score", {"queries": "a", "documents": "b", "instruction": "judge"}, "instruction", "not supported"),
    ("/rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": 4}, "max_tokens_per_doc", "not supported"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", "greater than or equal to 0"),
])
def test_bad_score_requests_are_refused_by_field(server: LiveServer, route: str, body: dict, param: str,
                                                  message: str) -> None:
    assert message in _error(_post(server, route, body), param)


def test_pooling_route_gives_the_embeddings_in_vllms_pooling_shape(server: LiveServer) -> None:
    """vLLM's /pooling, its embed task: the same vectors as /v1/embeddings; other tasks refused."""
    texts = ["The river flows to the sea.", "Hello"]
    embeddings = _embeddings(server, texts)
    for task in (None, "embed"):
        reply = _post(server, "/pooling", {"input": texts, **({} if task is None else {"task": task})}).json()
        assert reply["id"].startswith("pool-") and reply["object"] == "list"
        assert [item["object"] for item in reply["data"]] == ["pooling", "pooling"]
        np.testing.assert_allclose([item["data"] for item in reply["data"]], embeddings, atol=1e-6)
        assert reply["usage"]["prompt_tokens"] > 0
    _error(_post(server, "/pooling", {"input": "x", "task": "classify"}), "task")
