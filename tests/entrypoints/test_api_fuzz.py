"""Issue 12, acceptance 1 (routes): schemathesis (as vLLM runs on its own schema) generates
bodies, query strings and headers for every operation of the server's own /openapi.json
against a live `vllm-lite serve` on the tiny Qwen3. No answer may be a 5xx, every answer must
match the documented status codes, content types and schemas, and after each operation's batch
a greedy request still returns the tokens it returned before the fuzzing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import LiveServer, running_server
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

MODEL = "tiny-qwen3"
API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"model": MODEL, "prompt": "The river and the mountain", "max_tokens": 8, "temperature": 0}
EXAMPLES_PER_OPERATION = 50
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Small n and max_model_len keep every generated request cheap on 2 cores.
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("fuzz") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "64", "--max-n-sequences", "2")) as live:
        yield live


@pytest.fixture(scope="module")
def greedy_tokens(server: LiveServer) -> str:
    return _greedy(server)


def _greedy(server: LiveServer) -> str:
    response = httpx.post(f"{server.base_url}/v1/completions", json=GREEDY, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _schema(server_url: str) -> Any:
    raw = httpx.get(f"{server_url}/openapi.json", headers=AUTH, timeout=30).json()
    return schemathesis.openapi.from_dict(raw)


def _operations(server: LiveServer) -> list[Any]:
    schema = _schema(server.base_url)
    return [result.ok() for result in schema.get_all_operations()]


def test_every_route_survives_generated_requests(server: LiveServer, greedy_tokens: str) -> None:
    operations = _operations(server)
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health", "/ping"} <= paths
    for operation in operations:
        _fuzz(operation, server.base_url)
        assert _greedy(server) == greedy_tokens, f"greedy output changed after fuzzing {operation.label}"
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def _fuzz(operation: Any, base_url: str) -> None:
    """One batch: EXAMPLES_PER_OPERATION generated requests for one operation, each checked."""
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case: Any) -> None:
        case.call_and_validate(base_url=base_url, headers=AUTH, checks=CHECKS, timeout=60)

    check()
