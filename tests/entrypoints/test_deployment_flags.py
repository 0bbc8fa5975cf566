"""vLLM server flags that deployment scripts carry: CORS (--allowed-origins / -methods / -headers,
--allow-credentials; vLLM answers every origin by default), --disable-fastapi-docs,
--disable-uvicorn-access-log, --trust-remote-code (taken; a repository's code is never run),
--chat-template (a file, or the template itself), --enable-log-requests (and --enable-log-outputs)
with --max-log-len,
--disable-log-stats (the periodic stats line is on by default), --response-role, --tokenizer-mode,
--middleware (its own servers), --default-chat-template-kwargs, --return-tokens-as-token-ids and
--exclude-tools-when-tool-choice-none (one more server).
One live server with all of them; the defaults are checked on a default server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import REPO_ROOT, LiveServer, running_server
from transformers import AutoTokenizer

MODEL = "tiny-llama"
API_KEY = "sk-deploy"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
UI = "https://ui.example"
TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("deploy")
    (folder / "template.jinja").write_text(TEMPLATE)
    args = ("--max-model-len", "128", "--allowed-origins", f'["{UI}"]', "--allowed-methods", '["GET", "POST"]',
            "--allow-credentials", "--disable-fastapi-docs", "--disable-uvicorn-access-log", "--uvicorn-log-level",
            "info", "--trust-remote-code", "--chat-template", str(folder / "template.jinja"),
            "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "5", "--disable-log-stats",
            "--response-role", "narrator",
            "--tokenizer-mode", "auto")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_LOG_STATS_INTERVAL", "0.5")  # a stats line would come during the tests: none may
        with running_server(tiny_llama, folder / "server.log", MODEL, API_KEY, args) as live:
            yield live


def preflight(server: LiveServer, origin: str) -> httpx.Response:
    return httpx.options(f"{server.base_url}/v1/chat/completions", timeout=10,
                         headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                  "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_answers_the_allowed_origin_only(server: LiveServer) -> None:
    allowed = preflight(server, UI)  # a browser's preflight carries no API key
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == UI
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "POST" in allowed.headers["access-control-allow-methods"]
    assert preflight(server, "https://elsewhere.example").status_code == 400
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers={**AUTH, "Origin": UI},
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == UI


def test_no_docs_no_access_log_and_remote_code_flag_taken(server: LiveServer) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}", headers=AUTH, timeout=10).status_code == 404
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers=AUTH,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 200  # served with --trust-remote-code: a native model, no code run
    time.sleep(1.0)  # two stats intervals: a line would be in the log by now
    log = server.log()
    assert "Application startup complete" in log  # uvicorn's info lines are on...
    assert '"POST /v1/completions HTTP/1.1"' not in log  # ...its access lines are not
    assert "Avg generation throughput" not in log  # --disable-log-stats


def tokenize_messages(server: LiveServer, content: str) -> list[int]:
    reply = httpx.post(f"{server.base_url}/tokenize", headers=AUTH, timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def test_chat_template_flag_replaces_the_tokenizers(server: LiveServer, tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenize_messages(server, "a fox") == tokenizer.encode("<<a fox>>", add_special_tokens=False)
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "a fox"}], "max_tokens": 2,
                            "return_token_ids": True})
    assert chat.json()["prompt_token_ids"] == tokenizer.encode("<<a fox>>", add_special_tokens=False)


def test_response_role_with_add_generation_prompt_else_the_last_messages(server: LiveServer) -> None:
    def roles(stream: bool, **fields) -> list[str]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a fox"}], "max_tokens": 2, **fields}
        if not stream:
            reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=60, json=body)
            return [choice["message"]["role"] for choice in reply.json()["choices"]]
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                          json={**body, "stream": True}) as reply:
            return [json.loads(line[6:])["choices"][0]["delta"]["role"] for line in reply.iter_lines()
                    if line.startswith("data: {") and "role" in json.loads(line[6:])["choices"][0]["delta"]]

    assert roles(False) == roles(True) == ["narrator"]
    assert roles(False, add_generation_prompt=False) == roles(True, add_generation_prompt=False) == ["user"]
    batch = httpx.post(f"{server.base_url}/v1/chat/completions/batch", headers=AUTH, timeout=60,
                       json={"model": MODEL, "max_tokens": 2, "add_generation_prompt": False,
                             "messages": [[{"role": "user", "content": "a"}], [{"role": "system", "content": "b"}]]})
    assert [choice["message"]["role"] for choice in batch.json()["choices"]] == ["user", "system"]


def test_requests_are_logged_cut_to_max_log_len(server: LiveServer) -> None:
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers=AUTH,
                       json={"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2, "seed": 4242})
    request_id = reply.json()["id"]
    line = next(line for line in server.log().splitlines() if f"Received request {request_id}" in line)
    assert "prompt: 'The q'" in line and "seed=4242" in line
    ids = line.split("prompt_token_ids: ")[1]
    assert len(ids.strip("[]").split(",")) <= 5


def test_outputs_are_logged_whole_when_they_finish(server: LiveServer) -> None:
    """--enable-log-outputs: a finished completion's text (cut to --max-log-len), streamed deltas
    joined first."""
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers=AUTH,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 6, "ignore_eos": True})
    completion = reply.json()
    streamed = []
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, headers=AUTH,
                      json={"model": MODEL, "prompt": "yo", "max_tokens": 6, "ignore_eos": True,
                            "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                streamed.append(chunk["choices"][0]["text"])
                stream_id = chunk["id"]
    time.sleep(0.2)
    log = server.log()
    for request_id, text in ((completion["id"], completion["choices"][0]["text"]), (stream_id, "".join(streamed))):
        # (a completion's engine request is its id and the prompt's index)
        assert f"Generated response {request_id}-0: output: {text[:5]!r}, finish_reason: length" in log, log[-1500:]


def test_log_outputs_needs_log_requests(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(tmp_path / "no-model"),
               "--enable-log-outputs"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--enable-log-outputs logs beside --enable-log-requests" in result.stderr


MIDDLEWARE_MODULE = '''
class TagClass:
    """An ASGI middleware class: adds x-class to every HTTP response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-class", b"1")]}
            await send(message)
        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_function(request, call_next):
    response = await call_next(request)
    response.headers["x-function"] = request.url.path
    return response


NOT_MIDDLEWARE = 3
'''


def test_middleware_flag_wraps_the_app_in_classes_and_functions(plain_server: LiveServer) -> None:
    """vLLM's --middleware (repeatable): an ASGI class or an async function, by import path; they
    see every request, the ones the API key gate refuses too."""
    served = httpx.get(f"{plain_server.base_url}/v1/models", headers=AUTH, timeout=10)
    refused = httpx.get(f"{plain_server.base_url}/v1/models", timeout=10)
    assert served.status_code == 200 and refused.status_code == 401
    for reply in (served, refused):
        assert reply.headers["x-class"] == "1" and reply.headers["x-function"] == "/v1/models"


@pytest.fixture(scope="module")
def plain_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Default CORS, uvicorn's access log on (info) but not for the probes' paths, two user
    middlewares, a stats line every 0.5 s: one server for the tests of those flags (a server
    start is ~6 s of the suite)."""
    folder = tmp_path_factory.mktemp("plain")
    (folder / "user_middleware.py").write_text(MIDDLEWARE_MODULE)
    args = ("--max-model-len", "128", "--uvicorn-log-level", "info",
            "--middleware", "user_middleware.TagClass", "--middleware", "user_middleware.tag_function",
            "--disable-access-log-for-endpoints", "/health, /v1/models")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_LOG_STATS_INTERVAL", "0.5")
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
        with running_server(tiny_llama, folder / "server.log", MODEL, API_KEY, args) as live:
            yield live


def test_default_cors_answers_every_origin(plain_server: LiveServer, tiny_llama: Path) -> None:
    """Also: the stats line comes every VLLM_LOG_STATS_INTERVAL seconds while the engine works."""
    default = plain_server
    answer = preflight(default, "https://anywhere.example")
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    assert httpx.get(f"{default.base_url}/openapi.json", headers=AUTH, timeout=10).status_code == 200
    httpx.post(f"{default.base_url}/v1/completions", timeout=60, headers=AUTH,
               json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    httpx.post(f"{default.base_url}/v1/completions", timeout=60, headers=AUTH,
               json={"model": MODEL, "prompt": "hi", "max_tokens": 24, "ignore_eos": True})
    time.sleep(1.5)
    log = default.log()
    assert '"POST /v1/completions HTTP/1.1" 200' in log and "Received request" not in log
    assert "Generated response" not in log
    lines = [line for line in log.splitlines() if "Avg generation throughput:" in line]
    assert lines and any(" 0.0 tokens/s, Running" not in line for line in lines), lines
    assert "KV cache usage:" in lines[0] and "Prefix cache hit rate:" in lines[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # the tokenizer's own template, not the flag's
    assert tokenize_messages(default, "a fox") != tokenizer.encode("<<a fox>>", add_special_tokens=False)


@pytest.mark.parametrize(("path", "message"), [
    ("user_middleware.missing", "--middleware 'user_middleware.missing' does not import"),
    ("no_such_module.Thing", "--middleware 'no_such_module.Thing' does not import"),
    ("user_middleware.NOT_MIDDLEWARE", "must name an ASGI middleware class or an async function"),
])
def test_middleware_that_is_not_is_refused_before_the_model_loads(tmp_path: Path, path: str, message: str) -> None:
    (tmp_path / "user_middleware.py").write_text(MIDDLEWARE_MODULE)
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(tmp_path / "no-model"),
               "--middleware", path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


DEFAULTS_TEMPLATE = "{% for m in messages %}<{{ m.content }}>{% endfor %}{% if flag %}F{% endif %}{% if tools %}T{% endif %}"


@pytest.fixture(scope="module")
def defaults_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Its flags come from a YAML file (vLLM's `--config`; keys with dashes or underscores, a
    mapping for a JSON flag, true for a switch), one JSON flag key by key on the command line
    (`--structured-outputs-config.disable_any_whitespace true`, merged with the file's backend),
    and the file's served-model-name loses to the command line's (every test asks for MODEL)."""
    folder = tmp_path_factory.mktemp("defaults")
    (folder / "template.jinja").write_text(DEFAULTS_TEMPLATE)
    (folder / "config.yaml").write_text(f"""
max_model_len: 128
chat-template: {folder / "template.jinja"}
default-chat-template-kwargs:
  flag: true
return-tokens-as-token-ids: true
exclude_tools_when_tool_choice_none: true
scheduling-policy: priority
structured-outputs-config:
  backend: xgrammar
served-model-name: [not-{MODEL}]
""")
    args = ("--config", str(folder / "config.yaml"), "--structured-outputs-config.disable_any_whitespace", "true")
    with running_server(tiny_llama, folder / "server.log", MODEL, API_KEY, args) as live:
        yield live


def chat_prompt_text(server: LiveServer, tokenizer_dir: Path, **fields) -> str:
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "max_tokens": 1, "return_token_ids": True,
                             "messages": [{"role": "user", "content": "hi"}], **fields})
    assert reply.status_code == 200, reply.text
    return AutoTokenizer.from_pretrained(tokenizer_dir).decode(reply.json()["prompt_token_ids"])


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def test_default_chat_template_kwargs_apply_unless_the_request_sets_them(defaults_server: LiveServer,
                                                                         tiny_llama: Path) -> None:
    assert chat_prompt_text(defaults_server, tiny_llama) == "<hi>F"
    assert chat_prompt_text(defaults_server, tiny_llama, chat_template_kwargs={"flag": False}) == "<hi>"


def test_tools_leave_the_template_for_tool_choice_none(defaults_server: LiveServer, tiny_llama: Path) -> None:
    named = {"type": "function", "function": {"name": "f"}}
    assert chat_prompt_text(defaults_server, tiny_llama, tools=[TOOL], tool_choice=named) == "<hi>FT"
    assert chat_prompt_text(defaults_server, tiny_llama, tools=[TOOL], tool_choice="none") == "<hi>F"


def test_logprob_tokens_are_ids_unless_the_request_says(defaults_server: LiveServer) -> None:
    def tokens(**fields) -> list[str]:
        reply = httpx.post(f"{defaults_server.base_url}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1, **fields})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["logprobs"]["tokens"]

    assert all(token.startswith("token_id:") for token in tokens())
    assert not any(token.startswith("token_id:") for token in tokens(return_tokens_as_token_ids=False))


def test_default_chat_template_kwargs_may_not_set_the_requests_fields(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(tmp_path / "no-model"),
               "--default-chat-template-kwargs", '{"tools": []}']
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--default-chat-template-kwargs may not set tools" in result.stderr, \
        result.stderr[-2000:]


def test_access_log_leaves_out_the_named_endpoints(plain_server: LiveServer) -> None:
    """vLLM's --disable-access-log-for-endpoints: the probes' paths (with or without a query)
    leave no access line; every other request still does."""
    for path in ("/health", "/health?probe=1", "/v1/models", "/version"):
        assert httpx.get(f"{plain_server.base_url}{path}", headers=AUTH, timeout=10).status_code == 200
    time.sleep(0.5)
    log = plain_server.log()
    assert '"GET /version HTTP/1.1" 200' in log
    assert "GET /health" not in log and "GET /v1/models" not in log


def test_priority_needs_the_priority_policy(server: LiveServer, defaults_server: LiveServer) -> None:
    """vLLM's request field `priority`: served under --scheduling-policy priority (lower first),
    refused by name under fcfs (the default) unless 0."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": 3}
    served = httpx.post(f"{defaults_server.base_url}/v1/completions", headers=AUTH, timeout=60, json=body)
    assert served.status_code == 200, served.text
    chat = httpx.post(f"{defaults_server.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "priority": -1})
    assert chat.status_code == 200, chat.text
    refused = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60, json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "needs the priority scheduling policy" in refused.json()["error"]["message"]
    plain = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60, json={**body, "priority": 0})
    assert plain.status_code == 200
    huge = httpx.post(f"{defaults_server.base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "priority": 1 << 64})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "priority", huge.text


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def test_structured_outputs_config_makes_json_compact(server: LiveServer, defaults_server: LiveServer) -> None:
    """--structured-outputs-config '{"disable_any_whitespace": true}': JSON whose only whitespace
    is xgrammar's fixed separators ", " and ": " (vLLM's meaning); the default server's grammar
    allows any whitespace, and a random model takes it."""
    def free_whitespace(live: LiveServer) -> list[str]:
        reply = httpx.post(f"{live.base_url}/v1/completions", headers=AUTH, timeout=120,
                           json={"model": MODEL, "prompt": "json:", "max_tokens": 40, "n": 4, "seed": 11,
                                 "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "s", "schema": SCHEMA}}})
        assert reply.status_code == 200, reply.text
        texts = [choice["text"].replace(": ", "").replace(", ", "") for choice in reply.json()["choices"]]
        return [char for text in texts for char in text if char.isspace()]

    assert free_whitespace(defaults_server) == []
    assert free_whitespace(server) != []


@pytest.mark.parametrize(("config", "message"), [
    ('{"reasoning_parser": "qwen3"}', "reasoning_parser not supported"),
    ('{"backend": "outlines"}', "backend must be auto or xgrammar"),
])
def test_structured_outputs_config_refuses_what_it_does_not_do(tmp_path: Path, config: str, message: str) -> None:
    command = [sys.executable, "-m", "vllm_lite.entrypoints.cli", "serve", str(tmp_path / "no-model"),
               "--structured-outputs-config", config]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
