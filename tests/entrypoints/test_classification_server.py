"""vLLM's /classify on a classification model's server, and /score and /rerank on a cross-encoder's
(a one-label classifier): the answers are transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from classifier_models import build_classifier, hf_class_logits
from live_server import running_server

KEY = "cls-key"


def test_classify_route(tiny_qwen3: Path, tmp_path: Path, prompts_token_ids: list[list[int]]) -> None:
    model = build_classifier(tiny_qwen3, tmp_path / "classifier", num_labels=3)
    prompts = prompts_token_ids[:2]
    with running_server(model, tmp_path / "server.log", "clf", KEY) as server, \
            httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        reply = client.post("/classify", json={"model": "clf", "input": prompts})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["id"].startswith("classify-") and body["object"] == "list" and body["model"] == "clf"
        assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
        for i, (item, prompt) in enumerate(zip(body["data"], prompts, strict=True)):
            want = torch.softmax(hf_class_logits(model, prompt), -1)
            torch.testing.assert_close(torch.tensor(item["probs"]), want, atol=2e-5, rtol=1e-4)
            assert item["index"] == i and item["num_classes"] == 3
            assert item["label"] == f"class_{chr(97 + int(want.argmax()))}"
        raw = client.post("/classify", json={"model": "clf", "input": prompts[0], "use_activation": False}).json()
        torch.testing.assert_close(torch.tensor(raw["data"][0]["probs"]), hf_class_logits(model, prompts[0]),
                                   atol=2e-4, rtol=1e-4)
        pooled = client.post("/pooling", json={"model": "clf", "input": prompts[0]})  # (vLLM's: the model's task)
        assert pooled.status_code == 200 and pooled.json()["data"][0]["data"] == body["data"][0]["probs"], pooled.text
        assert client.post("/pooling", json={"model": "clf", "input": "x", "task": "embed"}).status_code == 400
        text = client.post("/classify", json={"model": "clf", "input": "hello there"})
        assert text.status_code == 200 and len(text.json()["data"]) == 1, text.text
        for route, body in [("/v1/embeddings", {"model": "clf", "input": "x"}),
                            ("/classify", {"model": "clf", "input": "x", "dimensions": 4}),
                            ("/v1/score", {"model": "clf", "text_1": "a", "text_2": "b"})]:
            refused = client.post(route, json=body)
            assert refused.status_code == 400, (route, refused.text)
    assert server.leftover_processes() == set()


@pytest.mark.parametrize("route", ["/score", "/rerank"])
def test_cross_encoder_scores(tiny_qwen3: Path, tmp_path: Path, route: str) -> None:
    from transformers import AutoTokenizer

    model = build_classifier(tiny_qwen3, tmp_path / "cross_encoder", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(model)
    query, documents = "what is a cat", ["a cat is an animal", "stocks fell", "cats purr"]
    expected = [torch.sigmoid(hf_class_logits(model, tokenizer(query, text_pair=d)["input_ids"]))[0].item()
                for d in documents]
    with running_server(model, tmp_path / "server.log", "ce", KEY) as server, \
            httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        body = ({"model": "ce", "text_1": query, "text_2": documents} if route == "/score"
                else {"model": "ce", "query": query, "documents": documents})
        reply = client.post(route, json=body)
        assert reply.status_code == 200, reply.text
        if route == "/score":
            got = [item["score"] for item in reply.json()["data"]]
        else:
            results = reply.json()["results"]
            assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results),
                                                                    reverse=True)
            got = [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])]
        assert got == pytest.approx(expected, abs=2e-5)
    assert server.leftover_processes() == set()
