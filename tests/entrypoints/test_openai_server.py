"""End to end against a live `vllm-lite serve` subprocess (tiny Qwen3, random local port):
the official `openai` client, 100 concurrent streams, client disconnects, bad requests,
`vllm-lite bench serve` and `vllm-lite chat --url`, and a clean shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LONG_GENERATION, LiveServer, running_long_server, running_server, started_children
from llm_factory import make_llm
from transformers import AutoTokenizer

from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.cli import main as cli_main

MODEL = "tiny-qwen3"
API_KEY = "sk-live-test"
MAX_MODEL_LEN = 256
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Tell me about the river and the mountain."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32")) as live:
        yield live


@pytest.fixture(scope="module")
def long_server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The server with room for a `LONG_GENERATION` reply (the disconnect tests')."""
    with running_long_server(tiny_qwen3, tmp_path_factory.mktemp("long_server") / "server.log", MODEL, API_KEY,
                             ("--dtype", "float32")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[LLM]:
    llm = make_llm(tiny_qwen3, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _metrics(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", headers=_headers(), timeout=10).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"^((?:vllm|vllm_lite):[\w:]+)\{([^}]*)\} (\S+)$", line)
        if match:
            labels = ",".join(p for p in match.group(2).split(",")
                              if not p.startswith("model_name=") and p != 'engine="0"')
            values[match.group(1) + (f"{{{labels}}}" if labels else "")] = float(match.group(3))
    return values


# ---- 1. the official openai client; greedy text equals LLM.generate ----


def test_completion_greedy_equals_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0)
    choice = response.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(llm.get_tokenizer().encode(PROMPT))
    assert response.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected.text


def test_chat_greedy_equals_llm_chat(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24, temperature=0.0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant" and response.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0.0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected


def test_n2_streaming_and_not(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 16
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0,
                                            stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_completion_logprobs_match_llm(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False)
    expected_output = expected[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for token_id, entry, logprob, top in zip(expected_output.token_ids, expected_output.logprobs,
                                             logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy: rank 1


def test_chat_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0.0,
                                              logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    # The tokens' texts join into the content, but for bytes that never formed a character: a
    # token ending inside one is "" (vLLM 0.32), the content shows them as replacement characters.
    assert "".join(item.token for item in content) == response.choices[0].message.content.replace("\ufffd", "")
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)
        assert bytes(item.bytes).decode(errors="replace") == item.token


def test_models_endpoint(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


# ---- 2. 100 concurrent streaming chat requests ----


async def _stream_chat(http: httpx.AsyncClient, index: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {index}: a story about a city"}],
            "max_tokens": 4 + index % 8, "temperature": 0.8, "seed": index, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    chunks = [json.loads(event) for event in events[:-1]]
    return {"index": index, "max_tokens": body["max_tokens"], "last": events[-1], "chunks": chunks,
            "messages": body["messages"]}


def test_100_concurrent_streaming_chats(server: LiveServer, tiny_qwen3: Path) -> None:
    async def run() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.base_url, headers=_headers(), limits=limits,
                                     timeout=httpx.Timeout(120.0)) as http:
            return await asyncio.gather(*(_stream_chat(http, i) for i in range(100)))

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    results = asyncio.run(run())
    assert sorted(r["index"] for r in results) == list(range(100))
    for result in results:
        assert result["last"] == "[DONE]"
        chunks = result["chunks"]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finish == ["length"]
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == result["max_tokens"]
        prompt = tokenizer.apply_chat_template(result["messages"], tokenize=False, add_generation_prompt=True)
        assert usage["prompt_tokens"] == len(tokenizer.encode(prompt, add_special_tokens=False))
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert len({c["id"] for c in chunks}) == 1


# ---- 3. a client that disconnects mid-stream ----


def test_disconnect_mid_stream_aborts_and_frees_kv(long_server: LiveServer) -> None:
    server = long_server
    before = _metrics(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_GENERATION, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=_headers(), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(2):
                assert next(line for line in lines if line.startswith("data: "))
            during = _metrics(server)
            assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0
        # Leaving the block closes the connection mid-stream.
    after = _wait_for(lambda: _settled(server))
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:num_requests_running"] == 0
    assert after["vllm_lite:request_aborted_total"] == before["vllm_lite:request_aborted_total"] + 1
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < LONG_GENERATION


def test_disconnect_before_non_streaming_response_aborts(long_server: LiveServer) -> None:
    server = long_server
    before = _metrics(server)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_GENERATION, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        _wait_for(lambda: True if _metrics(server)["vllm:num_requests_running"] == 1 else None)
    # The socket is closed while the server is still generating.
    after = _wait_for(lambda: _settled(server))
    assert after["vllm_lite:request_aborted_total"] == before["vllm_lite:request_aborted_total"] + 1


def test_a_request_failing_while_running_counts_as_vllms_error_finish(server: LiveServer) -> None:
    """A step fails on the request after admission (its allowed token is also a bad word: nothing
    left to sample): 400 naming the fields, counted as vLLM's finish reason "error" (not aborted)."""
    before = _metrics(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": [64], "bad_words": ["a"]}
    with httpx.Client(base_url=server.base_url, headers=_headers(), timeout=60) as http:
        token = http.post("/tokenize", json={"model": MODEL, "prompt": "a", "add_special_tokens": False}).json()
        response = http.post("/v1/completions", json={**body, "allowed_token_ids": token["tokens"]})
    assert response.status_code == 400 and "exclude every token" in response.json()["error"]["message"]
    after = _wait_for(lambda: _settled(server))
    error = 'vllm:request_success_total{finished_reason="error"}'
    assert after[error] == before[error] + 1
    assert after["vllm_lite:request_aborted_total"] == before["vllm_lite:request_aborted_total"]


def _settled(server: LiveServer) -> dict[str, float] | None:
    metrics = _metrics(server)
    idle = metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
    return metrics if idle else None


def _wait_for(probe: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = probe()
        if result is not None:
            return result
        time.sleep(0.05)
    raise AssertionError(f"condition not reached in {timeout_s} s")


# ---- 4. bad requests get OpenAI errors; the server keeps serving ----


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens", "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, 400, "temperature", "temperature must be in [0, 2]"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, 400, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "river " * 300}, 400, "prompt", "maximum context length is 256"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4o"}, 404, "model", "`gpt-4o` does not exist"),
])
def test_bad_requests(server: LiveServer, path: str, body: dict, status: int, param: str, words: str) -> None:
    response = httpx.post(server.base_url + path, json={"model": MODEL, **body}, headers=_headers(), timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param and words in error["message"]


def test_malformed_json_and_wrong_key(server: LiveServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                          headers={**_headers(), "content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x"},
                          headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"


def test_openai_client_raises_typed_errors_and_server_keeps_serving(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    wrong_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).choices[0].finish_reason
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_tokenize_detokenize(server: LiveServer, llm: LLM) -> None:
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}, headers=_headers()).json()
    assert tokens["tokens"] == llm.get_tokenizer().encode(PROMPT) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]},
                      headers=_headers()).json()["prompt"]
    assert text == PROMPT


# ---- 5. the CLI against the live server ----


def test_bench_serve_prints_metrics_table(server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "16",
                   "--input-len", "12", "--output-len", "8", "--ignore-eos", "--max-concurrency", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Serving Benchmark Result" in out
    assert re.search(r"Successful requests:\s+16\b", out) and re.search(r"Total generated tokens:\s+128\b", out)
    for label in ("Request throughput (req/s):", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 TPOT (ms):",
                  "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):"):
        assert label in out


def test_chat_cli_quick_against_server(server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["chat", "--url", server.base_url, "--api-key", API_KEY, "--quick", "hello there",
                   "--max-tokens", "6", "--temperature", "0"])
    assert rc == 0 and capsys.readouterr().out.strip()


# ---- last: a dead engine ends the server (exit status 1) and leaves no processes behind ----


def test_int32_edge_requests_fail_alone_through_http(server: LiveServer) -> None:
    """Issue 12, finding 1 through the real server and engine: top_k 2**31 (temperature > 0)
    and min_tokens 2**31 without max_tokens are 400s naming the field; the largest allowed values
    run; the engine serves the next greedy request unchanged."""
    def complete(**body: Any) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/completions", headers=_headers(), timeout=60,
                          json={"model": MODEL, "prompt": [5, 6, 7, 8], **body})

    greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    before = complete(**greedy).json()["choices"][0]["text"]
    for field, body in (("top_k", {"top_k": 2**31, "temperature": 1.0}), ("min_tokens", {"min_tokens": 2**31})):
        response = complete(**body)
        assert response.status_code == 400 and field in response.json()["error"]["message"]
    assert complete(top_k=2**31 - 1, temperature=1.0, max_tokens=4).status_code == 200
    assert complete(min_tokens=2**31 - 1, max_tokens=None).status_code == 200  # runs to max_model_len
    assert complete(**greedy).json()["choices"][0]["text"] == before


def test_dead_engine_core_exits_the_server_with_status_1(server: LiveServer) -> None:
    """Finding 8: the server does not stay up answering 503 forever; it exits non-zero so
    that its supervisor restarts it (vLLM's behaviour), and its children are reaped."""
    engine_cores = list(started_children(server.proc.pid, server.children))
    assert len(engine_cores) == 1
    os.kill(engine_cores[0], signal.SIGKILL)
    assert server.proc.wait(60) == 1, server.log()
    assert "the engine is dead" in server.log()
    assert server.leftover_processes() == set()
