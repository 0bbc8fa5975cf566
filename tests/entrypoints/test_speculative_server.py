"""`vllm-lite serve --speculative-config` (vLLM's flag, JSON or key by key): completions keep the
tokens of decoding without drafts, streamed ones too, and /metrics has vLLM's
vllm:spec_decode_* counters, counting what the server's requests drafted and kept."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, running_server

from hf_reference import build_cycling_model, hf_greedy
from speculative_heads import build_eagle3_head

MODEL = "cycling"
API_KEY = "sk-spec"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("cycling"), 0.05)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(model, tmp_path_factory.mktemp("spec") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256",
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                         "--speculative-config.prompt_lookup_max", "3",
                         "--speculative-config.prompt_lookup_min", "2")) as live:
        yield live


def _counter(metrics: str, name: str, labels: str = "") -> float:
    match = re.search(rf'^{re.escape(name)}_total{{[^}}]*{re.escape(labels)}[^}}]*}} (\S+)$', metrics, re.M)
    assert match, name
    return float(match.group(1))


def test_completions_keep_the_tokens_of_decoding_without_drafts(server: LiveServer, model: Path) -> None:
    expected = hf_greedy(model, [PROMPT], 80)[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        whole = client.post("/v1/completions", json=body).json()
        assert whole["choices"][0]["token_ids"] == expected
        streamed: list[int] = []
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        assert streamed == expected
        metrics = client.get("/metrics").text
    accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
    assert 0 < accepted < _counter(metrics, "vllm:spec_decode_num_draft_tokens")
    assert _counter(metrics, "vllm:spec_decode_num_drafts") > 0
    per_position = [_counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos", f'position="{p}"')
                    for p in range(4)]
    assert sum(per_position) == accepted
    assert _counter(metrics, "vllm:generation_tokens") == 160


@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_a_draft_model_or_head_over_http(model: Path, tmp_path_factory: pytest.TempPathFactory,
                                         drafter: str) -> None:
    """`--speculative-config '{"model": DRAFT, ...}'` (vLLM's draft-model method) and
    `'{"method": "eagle3", "model": HEAD, ...}'` (vLLM's EAGLE-3): the same tokens, drafts kept,
    the counters on /metrics."""
    folder = tmp_path_factory.mktemp(drafter)
    if drafter == "draft_model":
        config = {"model": str(build_cycling_model(folder, 0.0)), "num_speculative_tokens": 3}
    else:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        head = build_eagle3_head(folder / "head", model, mix=0.0, aux_layer_ids=[1, 2, 0], draft_vocab_size=vocab)
        config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with running_server(model, folder / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--speculative-config", json.dumps(config))) as live:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        with httpx.Client(base_url=live.base_url, headers=AUTH, timeout=60) as client:
            tokens = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
            metrics = client.get("/metrics").text
    assert tokens == hf_greedy(model, [PROMPT], 60)[0]
    assert 0 < _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
