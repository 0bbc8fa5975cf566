"""vLLM's `repetition_detection` request field on /v1/completions: the reply stops where vLLM's
check says (finish_reason "repetition", stop_reason "repetition_detected"), /metrics counts it
under finished_reason="repetition", and a value that cannot hold is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, running_server

from hf_reference import build_cycling_model, hf_greedy
from test_repetition_detection import MAX_TOKENS, PROMPT, first_stop


@pytest.fixture(scope="module")
def cycling(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cycling_model(tmp_path_factory.mktemp("cycling_repetition_server"), 0.0)


@pytest.fixture(scope="module")
def server(cycling: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(cycling, tmp_path_factory.mktemp("repetition") / "server.log", "cycling", "sk-rep",
                        ("--max-model-len", "256")) as live:
        yield live


def test_over_http(server: LiveServer, cycling: Path) -> None:
    expected = hf_greedy(cycling, [PROMPT], MAX_TOKENS)[0]
    params = {"max_pattern_size": 7, "min_count": 2}
    body = {"model": "cycling", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "repetition_detection": params}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": "Bearer sk-rep"}, timeout=60) as client:
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        bad = client.post("/v1/completions", json={**body, "repetition_detection": {"max_pattern_size": 3}})
        metrics = client.get("/metrics").text
    assert choice["token_ids"] == expected[:first_stop(expected, params)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition", "repetition_detected")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection.min_count"
    assert 'vllm:request_success_total{engine="0",finished_reason="repetition",model_name="cycling"} 1.0' in metrics
