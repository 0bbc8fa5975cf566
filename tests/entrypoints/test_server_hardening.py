"""Issue 12's server findings, in-process over the fake engine (httpx ASGI transport): every
error in OpenAI's shape (5, 12), limits and off-loop work (6), the API key on every route (7)
and /health's timeout (8). The live-server halves (exit on engine death, SIGTERM drain, a huge
prompt beside /health) are in test_server_lifecycle.py."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from vllm_lite.entrypoints.cli import build_parser
from vllm_lite.entrypoints.openai.api_server import begin_drain, build_app, server_options_from
from vllm_lite.entrypoints.openai.chat_template import TemplateRenderTimeout, call_with_deadline
from vllm_lite.entrypoints.openai.server_state import ServerOptions

API_KEY = "sk-hardening"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LOOPING_TEMPLATE = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"


async def _send(engine: Any, requests: list[tuple[str, str, dict[str, Any]]],
                options: ServerOptions) -> list[httpx.Response]:
    app = build_app(engine, [MODEL], options=options)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return [await client.request(method, path, **kwargs) for method, path, kwargs in requests]


def send(engine: Any, method: str, path: str, options: ServerOptions | None = None,
         headers: dict[str, str] | None = AUTH, **kwargs: Any) -> httpx.Response:
    options = options or ServerOptions(api_key=API_KEY)
    return asyncio.run(_send(engine, [(method, path, {"headers": headers, **kwargs})], options))[0]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                        words: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    assert words in error["message"], error
    return error


# --------------------------------------------------------------------------- finding 5


@pytest.mark.parametrize("prompt", [[2**70], [-1], [5, 2**31], [[3], [2**63]]])
def test_out_of_range_prompt_token_ids_are_400(engine: FakeEngine, prompt: list) -> None:
    response = send(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert_openai_error(response, 400, "prompt", "outside the vocabulary")
    assert engine.params == []  # nothing reached the engine


def test_non_int_token_ids_are_400_naming_prompt(engine: FakeEngine) -> None:
    response = send(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": [1.5, "x"]})
    assert_openai_error(response, 400, "prompt")


def test_a_bug_is_a_json_500_not_plain_text(tokenizer: Any) -> None:
    class BrokenEngine(FakeEngine):
        async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0,
                           lora_request: Any = None) -> Any:
            raise RuntimeError("a bug in the engine client")
            yield  # pragma: no cover

    response = send(BrokenEngine(tokenizer), "POST", "/v1/completions", json={"model": MODEL, "prompt": "x"})
    error = assert_openai_error(response, 500, None, "RuntimeError: a bug in the engine client")
    assert error["type"] == "InternalServerError"


# --------------------------------------------------------------------------- finding 12


def test_invalid_utf8_body_is_openai_400(engine: FakeEngine) -> None:
    response = send(engine, "POST", "/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                    headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(response, 400)
    assert "detail" not in response.json()


def test_deeply_nested_json_is_openai_400(engine: FakeEngine) -> None:
    body = '{"model": "tiny", "prompt": "x", "logit_bias": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = send(engine, "POST", "/v1/completions", content=body.encode(),
                    headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(response, 400)


def test_unknown_route_and_method_are_openai_errors(engine: FakeEngine) -> None:
    assert_openai_error(send(engine, "GET", "/v1/nothing-here"), 404)
    assert_openai_error(send(engine, "GET", "/v1/completions"), 405)


def test_max_completion_tokens_is_named_in_its_error(engine: FakeEngine) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}
    assert_openai_error(send(engine, "POST", "/v1/chat/completions", json=body), 400, "max_completion_tokens",
                        "max_completion_tokens must be >= 1")


@pytest.mark.parametrize("field, value, words", [
    ("temperature", 1e308, "temperature must be in [0, 2]"),
    ("top_p", 1e308, "top_p must be in (0, 1]"),
    ("min_p", -1e308, "min_p must be in [0, 1]"),
    ("frequency_penalty", 1e308, "frequency_penalty must be in [-2, 2]"),
    ("presence_penalty", -1e308, "presence_penalty must be in [-2, 2]"),
    ("repetition_penalty", 1e308, "repetition_penalty must be in [0.01, 100]"),
    ("top_k", 2**31, "top_k must be <= 2147483647"),
    ("min_tokens", 2**31, "min_tokens must be <= 2147483647"),
    ("max_tokens", 2**70, "max_tokens must be <= 2147483647"),
    ("seed", 2**70, "seed: Input should be less than or equal to 9223372036854775807"),
])
def test_absurd_numbers_are_400_naming_field_and_range(engine: FakeEngine, field: str, value: Any,
                                                       words: str) -> None:
    body = {"model": MODEL, "prompt": "x", field: value}
    assert_openai_error(send(engine, "POST", "/v1/completions", json=body), 400, field, words)


@pytest.mark.parametrize("literal", ["1e400", "NaN", "-Infinity"])
def test_non_finite_json_numbers_are_400(engine: FakeEngine, literal: str) -> None:
    body = f'{{"model": "tiny", "prompt": "x", "temperature": {literal}}}'.encode()
    response = send(engine, "POST", "/v1/completions", content=body,
                    headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(response, 400, "temperature")


# --------------------------------------------------------------------------- finding 6


def test_body_over_the_limit_is_413_before_parsing(engine: FakeEngine) -> None:
    options = ServerOptions(api_key=API_KEY, max_request_body_bytes=1000)
    body = {"model": MODEL, "prompt": "word " * 400}
    assert_openai_error(send(engine, "POST", "/v1/completions", options, json=body), 413, "body",
                        "--max-request-body-bytes")
    # A chunked body without content-length is counted as it arrives.
    chunks = [b'{"model": "tiny", "prompt": "', b"w" * 2000, b'"}']

    async def stream() -> Any:
        for chunk in chunks:
            yield chunk

    response = send(engine, "POST", "/v1/completions", options, content=stream(),
                    headers={**AUTH, "content-type": "application/json"})
    assert_openai_error(response, 413, "body")
    assert engine.params == []


def test_n_above_the_server_maximum_is_400_naming_n(engine: FakeEngine) -> None:
    options = ServerOptions(api_key=API_KEY, max_n_sequences=4)
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = send(engine, "POST", path, options, json={"model": MODEL, "n": 10000, **body})
        assert_openai_error(response, 400, "n", "--max-n-sequences")
    assert send(engine, "POST", "/v1/completions", options,
                json={"model": MODEL, "prompt": "x", "n": 4, "max_tokens": 1}).status_code == 200


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(engine: FakeEngine, tokenizer: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    response = send(engine, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x" * 3_000_000})
    assert_openai_error(response, 400, "prompt", "maximum context length is 64")
    assert calls == []


def test_request_chat_template_is_refused_unless_trusted(engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    for extra in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, **extra}
        assert_openai_error(send(engine, "POST", "/v1/chat/completions", json=body), 400, "chat_template",
                            "--trust-request-chat-template")
    trusted = ServerOptions(api_key=API_KEY, trust_request_chat_template=True)
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "chat_template": template}
    response = send(engine, "POST", "/v1/chat/completions", trusted, json=body)
    assert response.status_code == 200, response.text
    tokens = send(engine, "POST", "/tokenize", json={"model": MODEL, "prompt": "<hi>", "add_special_tokens": False})
    assert response.json()["usage"]["prompt_tokens"] == tokens.json()["count"]


def test_a_looping_trusted_template_is_stopped_and_the_server_goes_on(engine: FakeEngine) -> None:
    options = ServerOptions(api_key=API_KEY, trust_request_chat_template=True, chat_template_timeout_s=0.3)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": LOOPING_TEMPLATE}
    requests = [("POST", "/v1/chat/completions", {"json": body, "headers": AUTH}),
                ("POST", "/v1/completions", {"json": {"model": MODEL, "prompt": "x", "max_tokens": 1},
                                             "headers": AUTH})]
    looped, after = asyncio.run(_send(engine, requests, options))
    assert_openai_error(looped, 400, "chat_template", "longer than 0.3 s")
    assert after.status_code == 200


def test_deadline_stops_only_template_code() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(LOOPING_TEMPLATE)
    with pytest.raises(TemplateRenderTimeout):
        call_with_deadline(template.render, 0.2)
    assert call_with_deadline(lambda: sum(range(10)), 0.0) == 45  # plain Python is not traced


def test_health_answers_while_a_huge_text_is_tokenized(engine: FakeEngine) -> None:
    """Tokenization runs on the tokenizer thread: /health, sent after a large /tokenize began,
    is answered before the tokenization ends (on the event loop it would wait for it). 3.6 MB of text
    takes seconds to tokenize here, long past the 0.2 s after which /health is sent."""
    async def scenario() -> list[str]:
        app = build_app(engine, [MODEL], options=ServerOptions(api_key=API_KEY, max_request_body_bytes=2**24))
        finished: list[str] = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH, timeout=120) as client:
            async def tokenize() -> None:
                response = await client.post("/tokenize", json={"model": MODEL, "prompt": "hello world " * 300_000})
                assert response.status_code == 200 and response.json()["count"] > 100_000
                finished.append("tokenize")

            async def health() -> None:
                await asyncio.sleep(0.2)  # the tokenization has begun
                assert (await client.get("/health")).status_code == 200
                finished.append("health")

            await asyncio.gather(tokenize(), health())
        return finished

    assert asyncio.run(scenario()) == ["health", "tokenize"]


# --------------------------------------------------------------------------- finding 7


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/docs"), ("GET", "/openapi.json"),
    ("GET", "/redoc"), ("GET", "/no-such-route"),
])
def test_api_key_guards_every_route(engine: FakeEngine, method: str, path: str) -> None:
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_openai_error(send(engine, method, path, headers=headers), 401, "api_key")
    assert send(engine, method, path, json={}).status_code != 401


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")])
def test_health_and_ping_need_no_key(engine: FakeEngine, method: str, path: str) -> None:
    assert send(engine, method, path, headers=None).status_code == 200


def test_an_unauthenticated_body_is_never_read(engine: FakeEngine) -> None:
    options = ServerOptions(api_key=API_KEY, max_request_body_bytes=10)
    response = send(engine, "POST", "/tokenize", options, headers=None, json={"prompt": "x" * 100})
    assert_openai_error(response, 401, "api_key")  # not 413: the key is checked first


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key (one or more keys, vLLM's), else $VLLM_LITE_API_KEY, else vLLM's $VLLM_API_KEY:
    a vLLM deployment's key is never dropped, leaving the server open."""
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm-env")
    monkeypatch.setenv("VLLM_LITE_API_KEY", "sk-env")
    args = build_parser().parse_args(["serve"])
    assert server_options_from(args).api_key == "sk-env"
    args = build_parser().parse_args(["serve", "--api-key", "sk-flag"])
    assert server_options_from(args).api_key == ("sk-flag",)
    args = build_parser().parse_args(["serve", "--api-key", "sk-1", "sk-2", "--port", "1"])
    assert server_options_from(args).api_key == ("sk-1", "sk-2")
    monkeypatch.delenv("VLLM_LITE_API_KEY")
    assert server_options_from(build_parser().parse_args(["serve"])).api_key == "sk-vllm-env"
    monkeypatch.delenv("VLLM_API_KEY")
    assert server_options_from(build_parser().parse_args(["serve"])).api_key is None


def test_any_of_several_api_keys_is_accepted(engine: FakeEngine) -> None:
    options = ServerOptions(api_key=("sk-one", "sk-two"))
    for key in ("sk-one", "sk-two"):
        assert send(engine, "GET", "/v1/models", options, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for headers in ({"Authorization": "Bearer sk-three"}, {"Authorization": "Bearer sk-one sk-two"}, None):
        assert_openai_error(send(engine, "GET", "/v1/models", options, headers=headers), 401, "api_key")


# --------------------------------------------------------------------------- finding 8


def test_health_is_503_when_the_engine_does_not_answer(tokenizer: Any) -> None:
    class WedgedEngine(FakeEngine):
        async def check_health(self) -> None:
            await asyncio.sleep(3600)

    options = ServerOptions(health_check_timeout_s=0.2)
    response = send(WedgedEngine(tokenizer), "GET", "/health", options, headers=None)
    assert_openai_error(response, 503, None, "did not answer a health check within 0.2 s")


def test_health_is_503_when_the_engine_is_errored(engine: FakeEngine) -> None:
    engine.errored = True
    assert_openai_error(send(engine, "GET", "/health", headers=None), 503)
    assert_openai_error(send(engine, "GET", "/ping", headers=None), 503)


def test_serve_flags_reach_the_server_options() -> None:
    args = build_parser().parse_args([
        "serve", "--max-request-body-bytes", "123", "--max-n-sequences", "7", "--trust-request-chat-template",
        "--health-check-timeout", "1.5", "--shutdown-timeout", "2.5", "--chat-template-timeout", "0.5"])
    assert isinstance(args, argparse.Namespace)
    assert server_options_from(args) == ServerOptions(
        max_request_body_bytes=123, max_n_sequences=7, trust_request_chat_template=True, health_check_timeout_s=1.5,
        shutdown_timeout_s=2.5, chat_template_timeout_s=0.5)


def test_openapi_documents_the_error_shape(engine: FakeEngine) -> None:
    schema = json.loads(send(engine, "GET", "/openapi.json").text)
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "413", "500", "503"} <= set(responses)
    assert "ErrorResponse" in schema["components"]["schemas"]


# --------------------------------------------------------------------------- finding 9 (the drain)


def test_drain_finishes_short_requests_and_ends_the_rest_with_errors(tokenizer: Any) -> None:
    """After SIGTERM (begin_drain): a new request gets 503, a request that ends within
    --shutdown-timeout ends normally, and those still running then are aborted: a stream ends
    with an error event and [DONE], a non-streaming request gets a 503 body. The live server's
    signal wiring is tested in test_server_lifecycle.py."""
    engine = FakeEngine(tokenizer, max_model_len=100_000, step_delay_s=0.01)
    options = ServerOptions(api_key=API_KEY, shutdown_timeout_s=1.0)

    async def scenario() -> tuple[httpx.Response, httpx.Response, str, httpx.Response]:
        app = build_app(engine, [MODEL], options=options)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH, timeout=60) as client:
            async def stream_long() -> str:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 10_000, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    return "".join([line + "\n" async for line in response.aiter_lines()])

            long_stream = asyncio.ensure_future(stream_long())
            long_full = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 10_000}))
            short = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 5}))
            while len(engine.running) < 3:
                await asyncio.sleep(0.01)
            begin_drain(app.state.ctx)
            refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            return refused, await short, await long_stream, await long_full

    refused, short, long_stream, long_full = asyncio.run(scenario())
    assert_openai_error(refused, 503, None, "shutting down")
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    events = [line[len("data: "):] for line in long_stream.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "--shutdown-timeout" in error["message"]
    assert len(events) > 3  # it streamed tokens before the deadline
    assert_openai_error(long_full, 503, None, "--shutdown-timeout")
    assert engine.running == set()


# --------------------------------------------------------------------------- finding 13 (the server half)


def test_cache_salt_reaches_the_engine_prompt(engine: FakeEngine) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1, "cache_salt": "tenant-a"}
    assert send(engine, "POST", "/v1/completions", json=body).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": "t-b"}
    assert send(engine, "POST", "/v1/chat/completions", json=chat).status_code == 200
    plain = {"model": MODEL, "prompt": "c", "max_tokens": 1}
    assert send(engine, "POST", "/v1/completions", json=plain).status_code == 200
    assert [p.get("cache_salt") for p in engine.prompts] == ["tenant-a", "tenant-a", "t-b", None]
    empty = send(engine, "POST", "/v1/completions", json={**body, "cache_salt": ""})
    assert_openai_error(empty, 400, "cache_salt")
