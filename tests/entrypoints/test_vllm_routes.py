"""vLLM's extra routes in-process over the fake engine: /invocations (SageMaker) dispatching by
body shape, /load with --enable-server-load-tracking, /tokenize with return_token_strs,
/version and the development route /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1).
(/invocations against the real engine: test_vllm_extensions.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.version import __version__

API_KEY = "sk-routes"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _client(engine: FakeEngine, **options: Any) -> httpx.AsyncClient:
    app = build_app(engine, [MODEL], options=ServerOptions(api_key=API_KEY, **options))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=AUTH)


def _post(engine: FakeEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with _client(engine) as client:
            return await client.post(path, json=body)
    return asyncio.run(go())


def test_invocations_dispatches_chat_and_completion_bodies(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_model_len=64)
    chat = _post(engine, "/invocations", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = _post(engine, "/invocations", {"prompt": "hello", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    neither = _post(engine, "/invocations", {"input": "hello"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    bad = _post(engine, "/invocations", {"prompt": "hello", "max_tokens": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_invocations_needs_the_api_key(tokenizer: Any) -> None:
    async def go() -> httpx.Response:
        async with _client(FakeEngine(tokenizer, max_model_len=64)) as client:
            return await client.post("/invocations", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert asyncio.run(go()).status_code == 401


@pytest.mark.parametrize("tracking", [True, False])
def test_load_counts_generation_requests_in_flight(tokenizer: Any, tracking: bool) -> None:
    engine = FakeEngine(tokenizer, max_model_len=64, step_delay_s=0.05)

    async def go() -> tuple[list[int], int, int]:
        async with _client(engine, enable_server_load_tracking=tracking) as client:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 8}
            tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(3)]
            seen = []
            while not all(task.done() for task in tasks):
                seen.append((await client.get("/load")).json()["server_load"])
                await asyncio.sleep(0.02)
            after = (await client.get("/load")).json()["server_load"]
            await client.post("/v1/completions", json={**body, "stream": True})
            return seen, after, (await client.get("/load")).json()["server_load"]

    seen, after, after_stream = asyncio.run(go())
    assert (max(seen) == 3) if tracking else (set(seen) == {0})
    assert after == 0 and after_stream == 0


def test_tokenize_returns_token_strs_when_asked(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_model_len=64)
    data = _post(engine, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert data["token_strs"] == tokenizer.convert_ids_to_tokens(data["tokens"]) and data["count"] >= 2
    assert _post(engine, "/tokenize", {"prompt": "hello world"}).json()["token_strs"] is None


def test_tokenize_chat_takes_vllms_chat_fields(tokenizer: Any) -> None:
    """vLLM's TokenizeChatRequest: continue_final_message, tools, and add_special_tokens off by
    default for messages (the template adds them); both generation modes at once is 400."""
    engine = FakeEngine(tokenizer, max_model_len=64)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for fields in ({"add_generation_prompt": False, "continue_final_message": True}, {"tools": tools},
                   {"add_generation_prompt": False, "add_special_tokens": True}):
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=fields.get("add_generation_prompt", True),
                                             continue_final_message=fields.get("continue_final_message", False))
        data = _post(engine, "/tokenize", {"messages": conversation, **fields}).json()
        assert data["tokens"] == tokenizer.encode(text, add_special_tokens=fields.get("add_special_tokens", False))
    open_ended = _post(engine, "/tokenize", {"messages": conversation, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()["tokens"]
    closed = _post(engine, "/tokenize", {"messages": conversation, "add_generation_prompt": False}).json()["tokens"]
    assert closed[:len(open_ended)] == open_ended and len(closed) > len(open_ended)
    both = _post(engine, "/tokenize", {"messages": conversation, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_version_is_the_package_version(tokenizer: Any) -> None:
    async def go() -> httpx.Response:
        async with _client(FakeEngine(tokenizer, max_model_len=64)) as client:
            return await client.get("/version")
    assert asyncio.run(go()).json() == {"version": __version__}


def test_validation_messages_like_vllms(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_model_len=64)
    vocab = len(tokenizer)
    bias = {"1": 1.0, "x": 2.0, "-3": 1.0, "y": 0.5}
    error = _post(engine, "/v1/completions", {"prompt": "hi", "logit_bias": bias}).json()["error"]
    assert error["param"] == "logit_bias" and "'x'" in error["message"] and "'y'" in error["message"]
    assert "'-3'" in error["message"]
    bias = {str(vocab): 1.0, "2": 1.0, str(vocab + 5): 1.0}
    error = _post(engine, "/v1/completions", {"prompt": "hi", "logit_bias": bias}).json()["error"]
    assert error["message"] == (f"token_id(s) [{vocab}, {vocab + 5}] in logit_bias contain out-of-vocab token ids. "
                                f"Vocabulary size: {vocab}")
    error = _post(engine, "/v1/completions", {"prompt": [1, vocab + 2, vocab]}).json()["error"]
    assert error["message"].startswith(f"Token id {vocab + 2} is out of vocabulary") and error["param"] == "prompt"
    error = _post(engine, "/v1/completions", {"prompt": ""}).json()["error"]  # vLLM 0.32's validator
    assert error["message"] == "Either prompt or prompt_embeds must be provided and non-empty."
    assert error["param"] == "prompt"


def test_reset_prefix_cache_is_a_development_route(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's POST /reset_prefix_cache exists with VLLM_SERVER_DEV_MODE=1 only: {"success": false}
    while a request holds blocks, true when idle; reset_running_requests=true is refused by name.
    POST /reset_encoder_cache and /reset_mm_cache too (200, empty), reaching the engine."""
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.openai.api_server import server_options_from

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert server_options_from(build_parser().parse_args(["serve"])).dev_mode is True
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "yes")
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE must be 0 or 1, got 'yes'"):
        server_options_from(build_parser().parse_args(["serve"]))
    engine = FakeEngine(tokenizer, max_model_len=64, step_delay_s=0.05)

    async def go(dev_mode: bool) -> list[httpx.Response]:
        async with _client(engine, dev_mode=dev_mode) as client:
            idle = await client.post("/reset_prefix_cache")
            running = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8}))
            await asyncio.sleep(0.1)
            busy = await client.post("/reset_prefix_cache", params={"reset_external": "true"})
            await running
            refused = await client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            encoder = await client.post("/reset_encoder_cache")
            processor = await client.post("/reset_mm_cache")
            return [idle, busy, refused, encoder, processor]
    idle, busy, refused, encoder, processor = asyncio.run(go(True))
    assert encoder.status_code == processor.status_code == 200 and encoder.content == processor.content == b""
    assert engine.encoder_cache_resets == engine.mm_cache_resets == 1
    assert idle.json() == {"success": True} and busy.json() == {"success": False}
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reset_running_requests"
    idle, busy, _, encoder, processor = asyncio.run(go(False))
    assert idle.status_code == busy.status_code == encoder.status_code == processor.status_code == 404
    assert engine.encoder_cache_resets == engine.mm_cache_resets == 1
