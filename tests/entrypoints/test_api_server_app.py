"""The HTTP layer in-process (httpx ASGI transport) over a fake engine: OpenAI's response and
error shapes, SSE framing, metrics, and aborting requests whose consumer goes away. The live
server with the real engine is tested in test_openai_server.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.middleware.cors import CORSMiddleware
from fake_engine import FakeEngine
from recording_middleware import Recorder

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.middleware import ServerSend
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.entrypoints.openai.serving import merge_streams, start_stream, tracked_generate
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

API_KEY = "sk-test"
MODEL = "tiny"


async def _request(engine: FakeEngine, method: str, path: str, api_key: str | None = API_KEY,
                   **kwargs: Any) -> httpx.Response:
    app = build_app(engine, [MODEL], api_key=API_KEY)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 headers=headers) as client:
        return await client.request(method, path, **kwargs)


def request(engine: FakeEngine, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return asyncio.run(_request(engine, method, path, **kwargs))


def sse_payloads(response: httpx.Response) -> list[Any]:
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_completion_shape_n_and_logprobs(engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "n": 2, "logprobs": 2}
    response = request(engine, "POST", "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "text_completion" and data["model"] == MODEL and data["id"].startswith("cmpl-")
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 3
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"] == [0, 1, 2]
    usage = data["usage"]
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    sent = engine.params[-1]
    assert sent.n == 2 and sent.logprobs == 2 and sent.output_kind == RequestOutputKind.DELTA


def test_batch_prompts_index_by_prompt_then_sample(engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": [[4, 5], [5, 6, 7]], "max_tokens": 2, "n": 2, "stream": True}
    chunks = sse_payloads(request(engine, "POST", "/v1/completions", json=body))
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3]


def test_echo_prepends_the_prompt_once(engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 2, "echo": True}
    text = request(engine, "POST", "/v1/completions", json=body).json()["choices"][0]["text"]
    chunks = sse_payloads(request(engine, "POST", "/v1/completions", json={**body, "stream": True}))
    assert text.startswith("hello world") and "".join(c["choices"][0]["text"] for c in chunks) == text


def test_vllm_extra_fields_reach_sampling_params(engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
            "min_tokens": 1, "ignore_eos": True, "seed": 3, "stop": ["\n"], "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "logit_bias": {"7": 5.0}, "user": "u1", "temperature": 0.5, "top_p": 0.9}
    assert request(engine, "POST", "/v1/completions", json=body).status_code == 200
    p = engine.params[-1]
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos, p.seed) == (5, 0.1, 1.2, 1, True, 3)
    assert (p.stop, p.presence_penalty, p.frequency_penalty, p.logit_bias) == (["\n"], 0.5, 0.25, {7: 5.0})
    assert (p.temperature, p.top_p) == (0.5, 0.9)


def test_chat_stream_role_content_usage_done(engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}
    chunks = sse_payloads(request(engine, "POST", "/v1/chat/completions", json=body))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in content] == [None, None, "length"]
    top = content[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert [t["logprob"] for t in top] == [-0.1, -0.5]  # ranks 1 and 2, most likely first
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert engine.params[-1].max_tokens == 3


def test_chat_non_stream_uses_template(engine: FakeEngine, tokenizer: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 2, "n": 2}
    data = request(engine, "POST", "/v1/chat/completions", json=body).json()
    assert data["object"] == "chat.completion" and len(data["choices"]) == 2
    assert data["choices"][1]["message"]["role"] == "assistant"
    text = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                         tokenize=False, add_generation_prompt=True)
    assert data["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_max_tokens_past_the_context_is_capped_as_vllm_caps_it(engine: FakeEngine) -> None:
    """vLLM's rule (its get_max_tokens): a prompt and max_tokens that overflow max_model_len are not
    refused; max_tokens is capped at what the prompt leaves, per prompt, on each generation route."""
    prompts = [list(range(10, 20)), list(range(10, 60))]  # 10 and 50 tokens of a 64-token context
    reply = request(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 60})
    assert reply.status_code == 200, reply.text
    assert [params.max_tokens for params in engine.params] == [54, 14]
    engine.params.clear()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 64}
    reply = request(engine, "POST", "/v1/chat/completions", json=body)
    assert reply.status_code == 200 and engine.params[0].max_tokens == 64 - reply.json()["usage"]["prompt_tokens"]
    body = {**body, "max_completion_tokens": 65}
    error = request(engine, "POST", "/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "max_completion_tokens" and "cannot be greater than max_model_len=64" in error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be >= 1"),
    ({"temperature": -1}, "temperature", "temperature must be in [0, 2]"),
    ({"top_p": 2}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "word " * 80}, "prompt", "maximum context length is 64"),
    ({"max_tokens": 65, "prompt": "word " * 10}, "max_tokens", "max_tokens=65 cannot be greater than max_model_len=64"),
    ({"prompt": list(range(10, 74))}, "prompt", "leaves no room for the output"),
    ({"logprobs": 21}, "logprobs", "logprobs must be <= 20"),
    ({"logprobs": -2}, "logprobs", "logprobs must be a positive value or -1"),
    ({"prompt_logprobs": -3}, "prompt_logprobs", "prompt_logprobs must be a positive value or -1"),
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "greater than max_model_len (64)"),
    ({"n": "two"}, "n", "n: Input should be a valid integer"),
    ({"seed": 2**63}, "seed", "[type=less_than_equal]"),  # vLLM: a seed is a torch.long
    ({"seed": -(2**63) - 1}, "seed", "[type=greater_than_equal]"),
])
def test_invalid_completion_params_are_400_naming_the_field(engine: FakeEngine, body: dict, param: str,
                                                            words: str) -> None:
    response = request(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert words in error["message"]


def test_streaming_errors_come_before_the_stream(engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "logprobs": True, "top_logprobs": 30}
    response = request(engine, "POST", "/v1/chat/completions", json=body)
    # The engine's max_logprobs (20) refuses it, naming the sampling field top_logprobs becomes.
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_malformed_json_auth_and_unknown_model(engine: FakeEngine) -> None:
    response = request(engine, "POST", "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    response = request(engine, "POST", "/v1/completions", api_key="wrong", json={"prompt": "x"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
    assert request(engine, "GET", "/v1/models", api_key=None).status_code == 401
    assert request(engine, "GET", "/health", api_key=None).status_code == 200  # only /v1 needs the key
    response = request(engine, "POST", "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert response.status_code == 404 and "`gpt-4` does not exist" in response.json()["error"]["message"]


def test_dead_engine_is_503(engine: FakeEngine) -> None:
    engine.dead = True
    assert request(engine, "GET", "/health").status_code == 503
    response = request(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"
    response = request(engine, "POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x"}], "stream": True})
    assert response.status_code == 503


def test_models_tokenize_detokenize(engine: FakeEngine, tokenizer: Any) -> None:
    models = request(engine, "GET", "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 64
    tokens = request(engine, "POST", "/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["tokens"] == tokenizer.encode("hello world") and tokens["count"] == len(tokens["tokens"])
    text = request(engine, "POST", "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "hello world"
    response = request(engine, "POST", "/detokenize", json={"tokens": [10**7]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    chat = request(engine, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokenizer.decode(chat["tokens"]).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({}, "prompt"),
    ({"prompt": "hi", "chat_template": "{{ messages }}"}, "chat_template"),
    ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": "hi", "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"prompt": "hi", "tools": []}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]}, "tools"),
])
def test_tokenize_refuses_what_its_form_would_ignore(engine: FakeEngine, body: dict, param: str) -> None:
    """/tokenize takes a prompt or messages, not both; a chat field changed on a prompt would
    change nothing (refused by name, where vLLM ignores it); tools must be function tools, as on
    chat completions."""
    response = request(engine, "POST", "/tokenize", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_accepts_chat_defaults_on_a_prompt_and_function_tools(engine: FakeEngine, tokenizer: Any) -> None:
    plain = request(engine, "POST", "/tokenize", json={"prompt": "hello", "add_generation_prompt": True,
                                                       "continue_final_message": False, "tools": None})
    assert plain.status_code == 200 and plain.json()["tokens"] == tokenizer.encode("hello")
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    chat = request(engine, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "tools": [tool]})
    assert chat.status_code == 200 and chat.json()["count"] > 0


def test_metrics_exposes_engine_and_request_metrics(engine: FakeEngine) -> None:
    async def run() -> str:
        app = build_app(engine, [MODEL])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4})
            return (await client.get("/metrics")).text

    text = asyncio.run(run())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm_lite:prefix_cache_hit_rate", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert f"{name}{{" in text, name
    assert f'vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}} 4.0' in text
    assert f'vllm_lite:prefix_cache_hit_rate{{engine="0",model_name="{MODEL}"}} 0.4' in text
    assert f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{MODEL}"}} 1.0' in text
    assert f'vllm:request_generation_tokens_sum{{engine="0",model_name="{MODEL}"}} 4.0' in text
    vllm_names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                  if line.startswith("vllm:")}
    assert not {name for name in vllm_names if "prefix_cache_hit_rate" in name or "aborted" in name}
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 1.0' in text


def _sample_values(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_hold_what_vllms_grafana_dashboards_read(engine: FakeEngine) -> None:
    """vLLM's dashboards (examples/observability/dashboards/grafana) select every series by
    `engine` (from label_values(vllm:num_requests_running, engine)) and read the HTTP, process and
    cache metrics below; each was missing or unlabelled before."""
    async def run() -> str:
        app = build_app(engine, [MODEL])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4})
            await client.get("/health")
            await client.get("/metrics")
            return (await client.get("/metrics")).text

    values = _sample_values(asyncio.run(run()))

    def value(name: str, **labels: str) -> float:
        return values[(name, frozenset(labels.items()))]

    engine0 = {"model_name": MODEL, "engine": "0"}
    per_engine = [dict(labels) for name, labels in values
                  if name.startswith("vllm:") and not name.startswith("vllm:admission_rejections")]
    assert per_engine and all(labels["engine"] == "0" for labels in per_engine)
    assert value("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 1
    assert value("http_request_duration_seconds_count", handler="/v1/completions", method="POST") == 1
    assert not any(dict(labels).get("handler") in ("/health", "/metrics") for _, labels in values)  # (vLLM's)
    assert value("process_start_time_seconds") > 0 and ("python_gc_collections_total", frozenset(
        {"generation": "0"}.items())) in values
    assert value("vllm:engine_sleep_state", **engine0, sleep_state="awake") == 1
    assert value("vllm:engine_sleep_state", **engine0, sleep_state="discard_all") == 0
    assert value("vllm:admission_rejections_total", model_name=MODEL, reason="max_num_queued_reqs") == 0
    assert value("vllm:request_success_total", **engine0, finished_reason="error") == 0  # (there from the start)
    prompt = value("vllm:prompt_tokens_total", **engine0)
    assert prompt > 0 and value("vllm:prompt_tokens_by_source_total", **engine0, source="local_compute") == prompt
    assert value("vllm:prompt_tokens_cached_total", **engine0) == 0
    assert value("vllm:request_prefill_kv_computed_tokens_sum", **engine0) == prompt
    assert value("vllm:request_max_num_generation_tokens_sum", **engine0) == 4
    assert value("vllm:external_prefix_cache_queries_total", **engine0) == 0


def test_data_parallel_engines_have_series_of_their_own() -> None:
    """Data parallelism: each engine's stats (merged_stats' per_engine) and steps under its rank."""
    from vllm_lite.engine.stats import IterationStats
    from vllm_lite.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m", 64, {"block_size": "16"}, num_engines=2)
    metrics.record_iteration(IterationStats(engine_index=1, num_generation_tokens=3))
    values = _sample_values(metrics.render({"num_running": 3, "per_engine": [{"num_running": 1},
                                                                              {"num_running": 2, "sleep_level": 2}]}
                                           ).decode())

    def value(name: str, engine: str, **labels: str) -> float:
        return values[(name, frozenset({"model_name": "m", "engine": engine, **labels}.items()))]

    assert [value("vllm:num_requests_running", engine) for engine in "01"] == [1, 2]
    assert [value("vllm:generation_tokens_total", engine) for engine in "01"] == [0, 3]
    assert [value("vllm:engine_sleep_state", engine, sleep_state="discard_all") for engine in "01"] == [0, 1]
    assert {dict(labels)["engine"] for name, labels in values if name == "vllm:cache_config_info"} == {"0", "1"}


def test_two_apps_keep_separate_registries(engine: FakeEngine) -> None:
    first, second = build_app(engine, ["a"]), build_app(engine, ["b"])
    assert first.state.ctx.metrics.registry is not second.state.ctx.metrics.registry


@pytest.mark.parametrize("user_middleware", [False, True])
def test_stream_chunks_skip_the_start_only_layers(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch,
                                                  user_middleware: bool) -> None:
    """A streamed response's body chunks skip the layers that act on a response's start only
    (middleware.py): with no --middleware they go to the server's own `send` (ServerSend), so a
    layer where ServerErrorMiddleware sits sees the start only; a --middleware one sees every
    chunk. CORS sees and answers the start only; the bytes on the wire are the whole stream."""
    cors_messages: list[str] = []
    cors_send = CORSMiddleware.send

    async def counted_cors_send(self: Any, message: Any, send: Any, request_headers: Any) -> None:
        cors_messages.append(message["type"])
        await cors_send(self, message, send, request_headers)

    monkeypatch.setattr(CORSMiddleware, "send", counted_cors_send)
    monkeypatch.setattr(Recorder, "messages", [])
    options = ServerOptions(api_key=API_KEY, middleware=("recording_middleware.Recorder",) if user_middleware else ())

    async def run() -> httpx.Response:
        app = build_app(engine, [MODEL], options=options)
        served = ServerSend(app if user_middleware else Recorder(app))  # (else: where ServerErrorMiddleware is)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://test") as client:
            return await client.post("/v1/completions", headers={"Authorization": f"Bearer {API_KEY}",
                                                                 "Origin": "https://app.example"},
                                     json={"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True})

    response = asyncio.run(run())
    chunks = sse_payloads(response)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) and chunks[-1]["choices"][0]["finish_reason"]
    assert response.headers["access-control-allow-origin"] == "*"
    assert cors_messages == ["http.response.start"]
    assert Recorder.messages[0]["type"] == "http.response.start"
    bodies = [m["body"] for m in Recorder.messages if m["type"] == "http.response.body"]
    if user_middleware:
        assert b"".join(bodies) == response.content and len(bodies) == len(chunks) + 1  # then [DONE]
    else:
        assert bodies == []


# ---- consumers that stop early abort their requests ----


def _ctx(engine: FakeEngine) -> Any:
    return build_app(engine, [MODEL]).state.ctx


async def _consume_some(stream: AsyncIterator[Any], count: int) -> None:
    async for _ in stream:
        count -= 1
        if count == 0:
            break


def test_closed_stream_aborts_request(engine: FakeEngine) -> None:
    async def run() -> None:
        ctx = _ctx(engine)
        params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA)
        stream = await start_stream(tracked_generate(ctx, {"prompt_token_ids": [1, 2]}, params, "r1"))
        await _consume_some(stream, 3)
        await stream.aclose()
        await asyncio.sleep(0)
        assert engine.aborted == ["r1"] and not engine.running

    asyncio.run(run())


def test_cancelled_consumer_aborts_every_merged_request(engine: FakeEngine) -> None:
    async def run() -> None:
        ctx = _ctx(engine)
        engine.step_delay_s = 0.01
        params = SamplingParams(max_tokens=1000, output_kind=RequestOutputKind.DELTA)
        streams = [tracked_generate(ctx, {"prompt_token_ids": [1]}, params, f"r{i}") for i in range(3)]
        task = asyncio.ensure_future(_consume_some(merge_streams(streams), 10**6))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert sorted(engine.aborted) == ["r0", "r1", "r2"] and not engine.running

    asyncio.run(run())


def test_merged_streams_are_read_only_as_fast_as_the_consumer_reads() -> None:
    """A consumer that stops reading a merged stream stops the streams too (at most about one
    item per stream waits in the merge): their outputs stay in each request's own collector,
    where AsyncLLM merges them and aborts the request past its limit (test_backpressure.py)."""
    produced = [0, 0, 0]

    async def stream(index: int) -> AsyncIterator[int]:
        for item in range(1000):
            produced[index] += 1
            yield item
            await asyncio.sleep(0)

    async def run() -> None:
        merged = merge_streams([stream(i) for i in range(3)])
        await anext(merged)
        for _ in range(5000):  # the pumps get every chance to run ahead
            await asyncio.sleep(0)
        assert sum(produced) <= 2 * 3 + 1
        taken = 1 + len([item async for item in merged])
        assert taken == sum(produced) == 3000
        await merged.aclose()

    asyncio.run(run())


def test_serve_freezes_the_start_up_heap_before_serving(engine: FakeEngine, tiny_tokenizer_dir: Path) -> None:
    """`serve` hands uvicorn an app whose start-up objects (modules, tokenizer, app) the garbage
    collector no longer scans (gc.freeze, as vLLM's freeze_gc_heap): under load the API server
    spent about a quarter of its CPU in collections of them."""
    import gc

    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.openai.api_server import DrainingServer, serve

    frozen_when_serving: list[int] = []

    class RecordingServer(DrainingServer):
        async def serve(self, sockets: Any = None) -> None:
            frozen_when_serving.append(gc.get_freeze_count())

    args = build_parser().parse_args(["serve", str(tiny_tokenizer_dir), "--port", "0"])
    gc.unfreeze()
    try:
        assert asyncio.run(serve(args, lambda: engine, server_class=RecordingServer)) == 0
    finally:
        gc.unfreeze()  # (this test process keeps collecting as before)
    assert frozen_when_serving and frozen_when_serving[0] > 10_000


def test_add_special_tokens_as_vllm(tokenizer: Any) -> None:
    """vLLM's defaults: a completion's text prompt gets the tokenizer's special tokens, a chat's
    templated text does not (the template writes them); either can be turned around. The tiny
    tokenizer adds none, so a copy that puts a BOS first is served here."""
    import copy

    from tokenizers.processors import TemplateProcessing

    bos_tokenizer = copy.deepcopy(tokenizer)
    bos = bos_tokenizer.bos_token
    bos_tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_tokenizer.convert_tokens_to_ids(bos))])
    engine = FakeEngine(bos_tokenizer, max_model_len=64)
    prompt, chat = "hello world", [{"role": "user", "content": "hello"}]
    templated = bos_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    for add in (None, True, False):
        extra = {} if add is None else {"add_special_tokens": add}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}
        assert request(engine, "POST", "/v1/completions", json=body).status_code == 200
        want = bos_tokenizer.encode(prompt, add_special_tokens=add is not False)
        assert engine.prompts[-1]["prompt_token_ids"] == want
        body = {"model": MODEL, "messages": chat, "max_tokens": 1, **extra}
        assert request(engine, "POST", "/v1/chat/completions", json=body).status_code == 200
        assert engine.prompts[-1]["prompt_token_ids"] == bos_tokenizer.encode(templated, add_special_tokens=add is True)
    assert bos_tokenizer.encode(prompt) != bos_tokenizer.encode(prompt, add_special_tokens=False)
