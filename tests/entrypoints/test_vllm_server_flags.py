"""vLLM server flags found missing by running vLLM's own OpenAI-server tests against
`vllm-lite serve` (docs/vllm_conformance.md): --enable-prompt-tokens-details,
--enable-request-id-headers, --show-hidden-metrics-for-version, and the per-request preemption
histogram (vllm:request_num_preemptions). One live server with a KV cache small enough that
concurrent requests must be preempted."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_server import LiveServer, running_server

MODEL = "tiny-qwen3"
API_KEY = "sk-flags"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 8  # 128 token slots: four requests of 20 + 40 tokens cannot all stay resident


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("flags") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--block-size", str(BLOCK_SIZE),
                         "--num-kv-blocks", str(NUM_KV_BLOCKS), "--enable-prompt-tokens-details",
                         "--enable-request-id-headers", "--show-hidden-metrics-for-version", "0.31")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _prompt_ids(seed: int, length: int) -> list[int]:
    """Token ids unique per seed (no earlier request has cached their blocks)."""
    return [100 + (seed * 31 + k * 7) % 150 for k in range(length)]


def test_prompt_tokens_details_counts_prefix_cache_hits(client: openai.OpenAI) -> None:
    prompt = _prompt_ids(1, 40)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK_SIZE == 0 and cached < second.usage.prompt_tokens

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True})
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details.cached_tokens == cached


def test_prompt_tokens_details_in_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "river stone " * 12}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    final = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert final[-1].prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_request_id_header_echoed_or_generated(server: LiveServer) -> None:
    given = httpx.get(f"{server.base_url}/health", headers={"X-Request-Id": "Custom"}, timeout=10)
    assert given.headers.get_list("x-request-id") == ["Custom"]
    fresh = httpx.get(f"{server.base_url}/health", timeout=10).headers.get_list("x-request-id")
    assert len(fresh) == 1 and re.fullmatch(r"[0-9a-f]{32}", fresh[0])
    reply = httpx.post(f"{server.base_url}/v1/completions", headers={**AUTH, "X-Request-Id": "abc-1"}, timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert reply.status_code == 200 and reply.headers.get_list("x-request-id") == ["abc-1"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_request_num_preemptions_histogram(server: LiveServer) -> None:
    """Four requests of 60 tokens on 128 token slots: the scheduler preempts; every preemption
    is counted once in vllm:num_preemptions_total and once in the finished requests' histogram."""
    before = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=10).text

    async def run() -> list[int]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as aclient:
            replies = await asyncio.gather(*(
                aclient.completions.create(model=MODEL, prompt=_prompt_ids(10 + i, 20), max_tokens=40,
                                           temperature=0.0, extra_body={"ignore_eos": True}) for i in range(4)))
        return [reply.usage.completion_tokens for reply in replies]

    assert asyncio.run(run()) == [40] * 4
    after = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=10).text
    preemptions = _metric(after, "vllm:num_preemptions_total") - _metric(before, "vllm:num_preemptions_total")
    assert preemptions > 0
    histogram = "vllm:request_num_preemptions"
    assert _metric(after, f"{histogram}_count") - _metric(before, f"{histogram}_count") == 4
    assert _metric(after, f"{histogram}_sum") - _metric(before, f"{histogram}_sum") == preemptions
