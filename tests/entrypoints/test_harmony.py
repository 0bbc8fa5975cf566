"""gpt-oss's harmony replies, read as vLLM reads them: the analysis channel is the reasoning
(with --reasoning-parser openai_gptoss; left out without it), the final channel and commentary
preambles the content, messages to `functions.NAME` the tool calls (--tool-call-parser openai),
a built-in tool's messages left out; whole and streamed alike, on chat completions and the
Responses API. The server keeps gpt-oss's special tokens in its replies' text."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import ScriptedEngine

from vllm_lite.entrypoints.openai import harmony
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningStream, split_reasoning
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllm_lite.reasoning_tags import HARMONY_MARKERS, special_token_markers

MODEL = "gpt-oss"
API_KEY = "sk-harmony"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")
THINK_THEN_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                   "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
                   "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                   "<|message|>{\"city\": \"Paris\"}")


@pytest.mark.parametrize("text, keep_calls, expected", [
    (THINK_THEN_ANSWER, False, ("The user greets; answer briefly.", "Hello! How can I help?")),
    (THINK_THEN_CALL, False, ("Need the weather tool.", "Checking the weather.")),
    (THINK_THEN_CALL, True, ("Need the weather tool.", "Checking the weather.<|start|>assistant to=functions."
                                                       "get_weather<|channel|>commentary<|constrain|>json<|message|>"
                                                       "{\"city\": \"Paris\"}")),
    # the recipient in the role part, a bare content type; a built-in tool's message left out
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant to=python<|channel|>commentary code"
     "<|message|>print(1)<|call|>", True, ("a", None)),
    ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
     "<|start|>assistant<|channel|>final<|message|>x", False, ("one\ntwo", "x")),
    ("<|channel|>analysis<|message|>cut short", False, ("cut short", None)),  # (max_tokens inside the analysis)
    ('{"a": 1}', False, (None, '{"a": 1}')),  # a grammar's output: no header, all content
])
def test_harmony_replies_split_as_vllm_reads_them(text: str, keep_calls: bool,
                                                   expected: tuple[str | None, str | None]) -> None:
    assert harmony.split(text, keep_calls) == expected
    assert split_reasoning("openai_gptoss", text, keep_calls) == expected


def test_a_streamed_reply_splits_as_the_whole_one() -> None:
    for text in (THINK_THEN_ANSWER, THINK_THEN_CALL):
        stream = ReasoningStream("openai_gptoss", keep_calls=True)
        pieces = [stream.feed(text[i:i + 2], False) for i in range(0, len(text), 2)] + [stream.feed("", True)]
        reasoning = "".join(r for r, _ in pieces if r)
        content = "".join(c for _, c in pieces if c)
        assert (reasoning, content) == harmony.split(text, True)
        assert all("<|" not in (r or "") for r, _ in pieces)  # (no marker ever leaks into the reasoning)


def test_the_openai_tool_parser_reads_the_calls() -> None:
    _, content = harmony.split(THINK_THEN_CALL, True)
    parsed = TOOL_PARSERS["openai"](content, {})
    assert parsed.content == "Checking the weather."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    raw = harmony.split(THINK_THEN_CALL.replace("<|constrain|>json", "<|constrain|>text").replace(
        '{"city": "Paris"}', "Paris please"), True)[1]
    assert [c.arguments for c in TOOL_PARSERS["openai"](raw, {}).tool_calls] == ["Paris please"]


def _app(tokenizer: Any, script: list[str], **options: Any) -> Any:
    engine = ScriptedEngine(tokenizer, script)
    engine.vllm_config.model_config.hf.raw = {"model_type": "gpt_oss"}
    return build_app(engine, [MODEL], options=ServerOptions(api_key=API_KEY, **options))


def _pieces(text: str) -> list[str]:
    return [text[i:i + 3] for i in range(0, len(text), 3)]


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH) as client:
            return await client.post(path, json={"model": MODEL, **body})
    return asyncio.run(go())


def _streamed_chat(app: Any, body: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """(content, reasoning, tool-call deltas, finish_reason) of a streamed chat reply."""
    response = _post(app, "/v1/chat/completions", {**body, "stream": True})
    content, reasoning, calls, finish = "", "", [], None
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        calls += delta.get("tool_calls") or []
        finish = choice["finish_reason"] or finish
    return content, reasoning, calls, finish


ASK = {"messages": [{"role": "user", "content": "hi"}]}


def test_without_a_reasoning_parser_the_analysis_is_left_out(tokenizer: Any) -> None:
    app = _app(tokenizer, _pieces(THINK_THEN_ANSWER))
    message = _post(app, "/v1/chat/completions", ASK).json()["choices"][0]["message"]
    assert message["content"] == "Hello! How can I help?" and message.get("reasoning") is None
    assert _streamed_chat(app, ASK) == ("Hello! How can I help?", "", [], "stop")


def test_openai_gptoss_and_openai_parsers(tokenizer: Any) -> None:
    app = _app(tokenizer, _pieces(THINK_THEN_ANSWER), reasoning_parser="openai_gptoss")
    message = _post(app, "/v1/chat/completions", ASK).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("The user greets; answer briefly.", "Hello! How can I help?")
    hidden = _post(app, "/v1/chat/completions", {**ASK, "include_reasoning": False}).json()["choices"][0]["message"]
    assert hidden.get("reasoning") is None and hidden["content"] == "Hello! How can I help?"
    assert _streamed_chat(app, ASK)[:2] == ("Hello! How can I help?", "The user greets; answer briefly.")

    app = _app(tokenizer, _pieces(THINK_THEN_CALL), reasoning_parser="openai_gptoss",
               enable_auto_tool_choice=True, tool_call_parser="openai")
    body = {**ASK, "tools": [WEATHER]}
    choice = _post(app, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking the weather."
    assert choice["message"]["reasoning"] == "Need the weather tool."
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    content, reasoning, calls, finish = _streamed_chat(app, body)
    assert (content, reasoning, finish) == ("Checking the weather.", "Need the weather tool.", "tool_calls")
    assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["get_weather"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert len(calls) > 2  # (the arguments stream as they are generated, in pieces)
    # tool_choice none: the call is left out, as vLLM leaves it without a tool parser
    message = _post(app, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()["choices"][0]["message"]
    assert message["content"] == "Checking the weather." and not message.get("tool_calls")


def test_responses_api_items(tokenizer: Any) -> None:
    app = _app(tokenizer, _pieces(THINK_THEN_ANSWER), reasoning_parser="openai_gptoss")
    output = _post(app, "/v1/responses", {"input": "hi"}).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[1]["content"][0]["text"] == "Hello! How can I help?"


def test_other_parsers_are_refused_for_gpt_oss(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="--reasoning-parser must be openai_gptoss"):
        _app(tokenizer, ["x"], reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="--tool-call-parser must be openai"):
        _app(tokenizer, ["x"], enable_auto_tool_choice=True, tool_call_parser="hermes")


def harmony_tokenizer(tiny_tokenizer_dir: Path) -> Any:
    """The tiny tokenizer with gpt-oss's harmony markers as special tokens (a fresh one: the
    shared fixture is not changed)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_MARKERS)})
    return tokenizer


def test_gpt_oss_special_tokens_are_kept_in_the_text(tiny_tokenizer_dir: Path) -> None:
    """The markers are special tokens in gpt-oss's tokenizer: kept in the replies' text, else the
    parser would never see them (vLLM reads token ids; here the text keeps them)."""
    tokenizer = harmony_tokenizer(tiny_tokenizer_dir)
    assert special_token_markers(tokenizer, HARMONY_MARKERS) == HARMONY_MARKERS
    app = _app(tokenizer, _pieces(THINK_THEN_ANSWER))
    assert set(app.state.ctx.reasoning_special_markers) == set(HARMONY_MARKERS)


def test_reasoning_tokens_count_the_analysis_bodies(tokenizer: Any, tiny_tokenizer_dir: Path) -> None:
    """vLLM's usage.completion_tokens_details.reasoning_tokens for gpt-oss: the analysis bodies' tokens."""
    from vllm_lite.entrypoints.openai.reasoning_parsers import ReasoningTokenCounter, reasoning_count_tokens

    assert reasoning_count_tokens(tokenizer, "openai_gptoss") is None  # (no harmony tokens: counted as 0)
    tokenizer = harmony_tokenizer(tiny_tokenizer_dir)
    tokens = reasoning_count_tokens(tokenizer, "openai_gptoss")
    ids = tokenizer.encode(THINK_THEN_CALL, add_special_tokens=False)
    counter = ReasoningTokenCounter.for_parser("openai_gptoss", tokens)
    for token_id in ids:  # (fed one token at a time, as a stream does)
        counter.feed([token_id])
    assert counter.count == len(tokenizer.encode("Need the weather tool.", add_special_tokens=False))


def test_an_assistant_turns_reasoning_reaches_gpt_oss_templates_as_thinking() -> None:
    """gpt-oss's chat template renders an assistant tool-call turn's analysis from `thinking`
    (vLLM's harmony renderer takes the message's `reasoning`)."""
    from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, template_message

    request = ChatCompletionRequest(model=MODEL, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "reasoning": "Need the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert template_message(request.messages[1])["thinking"] == "Need the tool."


def test_responses_api_function_calls(tokenizer: Any) -> None:
    app = _app(tokenizer, _pieces(THINK_THEN_CALL), reasoning_parser="openai_gptoss",
               enable_auto_tool_choice=True, tool_call_parser="openai")
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    output = _post(app, "/v1/responses", {"input": "weather in Paris?", "tools": [tool]}).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert (output[2]["name"], json.loads(output[2]["arguments"])) == ("get_weather", {"city": "Paris"})
