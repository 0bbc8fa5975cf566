"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` client: in-process over a scripted engine (thinking, text and tool_use blocks, whole
and streamed, stop reasons, usage, the conversation as the chat template sees it, errors in
Anthropic's shape), and on a live server of a real model, whose greedy replies equal
/v1/chat/completions' for the same conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2  # (the anthropic client's HTTP library)
import openai
import pytest
from fake_engine import ScriptedEngine
from live_server import LiveServer, running_server
from transformers import AutoTokenizer

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions

MODEL = "claude-3-7-sonnet-latest"  # (a served model name, as vLLM's own test serves it)
API_KEY = "sk-anthropic"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                             "days": {"type": "integer", "minimum": 1,
                                                                      "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0}  # (the newest anthropic clients no longer have the argument)
# Every field the conversion hands the template, so the rendered prompt shows it.
SHOW_ALL = ("{% for m in messages %}[{{ m.role }}|{{ m.content if m.content is string else m.content | tojson }}"
            "{% if m.reasoning_content %}|think:{{ m.reasoning_content }}{% endif %}"
            "{% if m.tool_calls %}|calls:{{ m.tool_calls | tojson }}{% endif %}"
            "{% if m.tool_call_id %}|answers:{{ m.tool_call_id }}{% endif %}]{% endfor %}"
            "{% if tools %}tools:{{ tools | tojson }}{% endif %}"
            "{% if enable_thinking is defined %}thinking:{{ enable_thinking }}{% endif %}")


def _app(tokenizer_dir: Path, script: list[str], template: str = SHOW_ALL, **engine_args: Any) -> tuple[Any, Any]:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tokenizer_dir), script, **engine_args)
    engine.tokenizer.chat_template = template
    options = ServerOptions(api_key=API_KEY, reasoning_parser="qwen3", enable_auto_tool_choice=True,
                            tool_call_parser="hermes")
    return build_app(engine, [MODEL], options=options), engine


def _run(app: Any, work: Any) -> Any:
    """`work(client)` against the app in process, through the official client (x-api-key)."""
    async def go() -> Any:
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
        async with anthropic.AsyncAnthropic(base_url="http://test", api_key=API_KEY, http_client=http,
                                            max_retries=0) as client:
            return await work(client)
    return asyncio.run(go())


def _streamed_and_whole(tokenizer_dir: Path, script: list[str], **body: Any) -> tuple[list[Any], Any, Any]:
    """The stream's events, the message the client assembles from them, and the same request unstreamed."""
    app, _ = _app(tokenizer_dir, script)

    async def work(client: anthropic.AsyncAnthropic) -> tuple[list[Any], Any, Any]:
        fields = {"model": MODEL, "max_tokens": 100, "messages": ASK, **body}
        async with client.messages.stream(**fields) as stream:
            events = [event async for event in stream if not event.type.endswith(("text", "input_json",
                                                                                  "thinking", "signature"))]
            assembled = await stream.get_final_message()
        return events, assembled, await client.messages.create(**fields)
    return _run(app, work)


def _collapse(kinds: list[str]) -> list[str]:
    return [kind for i, kind in enumerate(kinds) if i == 0 or kind != kinds[i - 1]]


def test_thinking_and_text_blocks(tiny_tokenizer_dir: Path) -> None:
    script = ["<th", "ink>Let me ", "think.</th", "ink>\n\nThe ans", "wer."]
    events, assembled, whole = _streamed_and_whole(tiny_tokenizer_dir, script)
    assert _collapse([e.type for e in events]) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[-1] == "text_delta" and "signature_delta" in deltas  # (a thinking block ends with its signature)
    for message in (assembled, whole):
        thinking, text = message.content
        assert (thinking.type, thinking.thinking) == ("thinking", "Let me think.") and thinking.signature
        assert (text.type, text.text) == ("text", "The answer.")
        assert message.stop_reason == "end_turn" and message.stop_sequence is None and message.role == "assistant"
        assert message.id.startswith("msg_") and message.model == MODEL
        assert message.usage.output_tokens == len(script) and message.usage.input_tokens > 0


def test_thinking_display_omitted_keeps_the_block_without_its_text(tiny_tokenizer_dir: Path) -> None:
    events, assembled, whole = _streamed_and_whole(tiny_tokenizer_dir, ["<think>secret</think>", "Hi."],
                                                   thinking={"type": "adaptive", "display": "omitted"})
    assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    for message in (assembled, whole):
        thinking, text = message.content
        assert (thinking.type, thinking.thinking, text.text) == ("thinking", "", "Hi.") and thinking.signature


def test_tool_use_blocks_streamed_in_pieces(tiny_tokenizer_dir: Path) -> None:
    text = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}</tool_call>')
    events, assembled, whole = _streamed_and_whole(tiny_tokenizer_dir, [text[i:i + 4] for i in range(0, len(text), 4)],
                                                   tools=[WEATHER])
    json_deltas = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(json_deltas) > 6, "a call's input is streamed as it is generated"
    for message in (assembled, whole):
        assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == "Sure."
        assert [block.input for block in message.content[1:]] == [{"city": "Paris", "days": 2},
                                                                   {"city": "Rome", "days": 3}]
        assert all(block.name == "get_weather" and block.id for block in message.content[1:])
        assert message.stop_reason == "tool_use"


@pytest.mark.parametrize(("script", "texts"), [
    (["\n", "\n "], ["\n\n "]), (["<think>hm</think>", " \n"], [" \n"]),
    (["\n\n", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}</tool_call>'], [])])
def test_a_whitespace_reply_is_a_text_block_unless_beside_a_tool_call(tiny_tokenizer_dir: Path, script: list[str],
                                                                      texts: list[str]) -> None:
    """vLLM keeps a reply that is only whitespace as its text (no text is lost), whole and
    streamed alike; whitespace beside a tool call is no text block."""
    events, assembled, whole = _streamed_and_whole(tiny_tokenizer_dir, script, tools=[WEATHER])
    for message in (assembled, whole):
        assert [block.text for block in message.content if block.type == "text"] == texts
        assert [block.type for block in message.content].count("tool_use") == (0 if texts else 1)


def test_a_tool_call_cut_by_max_tokens_is_text(tiny_tokenizer_dir: Path) -> None:
    """A call whose input was cut short is no tool_use (it could not run): its text is kept."""
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    app, _ = _app(tiny_tokenizer_dir, [cut], finish_reason="length")
    whole = _run(app, lambda client: client.messages.create(model=MODEL, max_tokens=5, messages=ASK,
                                                            tools=[WEATHER]))
    assert whole.stop_reason == "max_tokens"
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text == cut


@pytest.mark.parametrize(("finish", "stop_reason", "expected"), [
    ("stop", "END", ("stop_sequence", "END")), ("stop", 2, ("end_turn", None)), ("stop", None, ("end_turn", None)),
    ("length", None, ("max_tokens", None))])
def test_stop_reasons(tiny_tokenizer_dir: Path, finish: str, stop_reason: Any, expected: tuple) -> None:
    app, _ = _app(tiny_tokenizer_dir, ["Hello", " there"], finish_reason=finish, stop_reason=stop_reason)

    async def work(client: anthropic.AsyncAnthropic) -> list[Any]:
        fields = {"model": MODEL, "max_tokens": 10, "messages": ASK, "stop_sequences": ["END"]}
        async with client.messages.stream(**fields) as stream:
            streamed = await stream.get_final_message()
        return [streamed, await client.messages.create(**fields)]
    for message in _run(app, work):
        assert (message.stop_reason, message.stop_sequence) == expected


def test_the_conversation_reaches_the_template_as_chat_would_render_it(tiny_tokenizer_dir: Path) -> None:
    """system (Claude Code's billing header left out), tool_use -> tool_calls, tool_result ->
    a tool message before the turn's text, thinking -> reasoning: the prompt is the one
    /v1/chat/completions renders for the same conversation in OpenAI's form."""
    app, engine = _app(tiny_tokenizer_dir, ["ok"])
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call it.", "signature": "abc"},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"},
                                                                            {"type": "text", "text": "21 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}]
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Calling.", "reasoning": "I should call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny\n21 C"},
        {"role": "user", "content": "And tomorrow?"}]
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                                  "description": WEATHER["description"]}}

    async def work(client: anthropic.AsyncAnthropic) -> None:
        system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=123;"},
                  {"type": "text", "text": "Be brief."}]
        await client.messages.create(model=MODEL, max_tokens=5, system=system, messages=messages, tools=[WEATHER],
                                     thinking={"type": "disabled"})
        counted = await client.messages.count_tokens(model=MODEL, system=system, messages=messages, tools=[WEATHER],
                                                     thinking={"type": "disabled"})
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=http) as oai:
            await oai.chat.completions.create(model=MODEL, max_tokens=5, messages=chat_messages, tools=[chat_tool],
                                              reasoning_effort="none")
        assert counted.input_tokens == len(engine.prompts[0]["prompt_token_ids"])
    _run(app, work)
    anthropic_prompt, chat_prompt = (engine.tokenizer.decode(p["prompt_token_ids"]) for p in engine.prompts)
    assert anthropic_prompt == chat_prompt
    assert "think:I should call it." in anthropic_prompt and "answers:toolu_1" in anthropic_prompt
    assert "billing" not in anthropic_prompt and "thinking:False" in anthropic_prompt


def test_a_tool_result_without_content_is_an_empty_tool_message(tiny_tokenizer_dir: Path) -> None:
    app, engine = _app(tiny_tokenizer_dir, ["ok"])
    _run(app, lambda client: client.messages.create(model=MODEL, max_tokens=5, messages=[
        *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}], tools=[WEATHER]))
    assert "[tool||answers:t1]tools:" in engine.tokenizer.decode(engine.prompts[0]["prompt_token_ids"])


def test_inline_system_messages_merge_when_the_template_wants_one_system_first(tiny_tokenizer_dir: Path) -> None:
    strict = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
              "{{ raise_exception('system messages must come first') }}{% endif %}"
              "[{{ m.role }}|{{ m.content }}]{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Reminder."},
                {"role": "user", "content": "again"}]
    prompts = []
    for template in (strict, SHOW_ALL):
        app, engine = _app(tiny_tokenizer_dir, ["ok"], template=template)
        _run(app, lambda client: client.messages.create(model=MODEL, max_tokens=5, system="Rules.",
                                                        messages=messages))
        prompts.append(engine.tokenizer.decode(engine.prompts[0]["prompt_token_ids"]))
    assert prompts[0] == "[system|Rules.Reminder.][user|hi][user|again]"
    assert prompts[1].startswith("[system|Rules.][user|hi][system|Reminder.][user|again]")


def test_sampling_fields_become_the_chat_request_s(tiny_tokenizer_dir: Path) -> None:
    app, engine = _app(tiny_tokenizer_dir, ['{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    _run(app, lambda client: client.messages.create(
        model=MODEL, max_tokens=7, messages=ASK, stop_sequences=["x", "y"], metadata={"user_id": "u1"},
        cache_control={"type": "ephemeral"}, output_config={"format": {"type": "json_schema", "schema": schema}},
        # (the newest clients no longer send these; vLLM's server and older clients do)
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5}))
    params = engine.params[0]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 5)
    assert params.stop == ["x", "y"] and params.structured_outputs.json == schema


def test_thinking_enabled_is_vllm_s_thinking_token_budget(tiny_tokenizer_dir: Path) -> None:
    app, engine = _app(tiny_tokenizer_dir, ["<think>hm</think>", "Hi."], max_model_len=8192)
    whole = _run(app, lambda client: client.messages.create(model=MODEL, max_tokens=4096, messages=ASK,
                                                            thinking={"type": "enabled", "budget_tokens": 2048}))
    assert engine.params[0].thinking_token_budget == 2048
    assert [block.type for block in whole.content] == ["thinking", "text"]


def test_forced_tool_choices_constrain_the_output(tiny_tokenizer_dir: Path) -> None:
    app, engine = _app(tiny_tokenizer_dir, ['{"city": "Oslo", "days": 2}'])
    whole = _run(app, lambda client: client.messages.create(
        model=MODEL, max_tokens=50, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}))
    assert engine.params[0].structured_outputs.json == {**WEATHER["input_schema"]}
    (block,) = whole.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Oslo", "days": 2})
    assert whole.stop_reason == "tool_use"  # (Anthropic's, for a forced call too)
    app, engine = _app(tiny_tokenizer_dir, ['[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]'])
    whole = _run(app, lambda client: client.messages.create(
        model=MODEL, max_tokens=50, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert engine.params[0].structured_outputs.json["maxItems"] == 1
    assert [b.input for b in whole.content] == [{"city": "Oslo", "days": 2}] and whole.stop_reason == "tool_use"


def _error(app: Any, body: dict[str, Any], path: str = "/v1/messages",
           headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async def go() -> tuple[int, dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            reply = await http.post(path, json=body, headers=headers or {"x-api-key": API_KEY})
            return reply.status_code, reply.json()
    return asyncio.run(go())


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "mcp_servers": []}, "mcp_servers"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 2048}},
     "budget_tokens must be less than max_tokens"),
    ({"max_tokens": 4096, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 100}}, ">= 1024"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "image inputs are not taken here"),  # (an image block as chat's image_url part; tests/entrypoints/test_image_server.py)
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "documents"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [
        {"type": "char_location"}]}]}]}, "citations"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]}, "cannot be in a assistant message"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "not in tools"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice needs tools"),
    ({"max_tokens": 5, "messages": []}, "at least one"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"max_tokens": 513, "messages": ASK}, "max_tokens=513 cannot be greater than max_model_len=512"),
    ({"max_tokens": 5, "messages": ASK, "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "adaptive", "display": "updates"}}, "thinking.display"),
    ({"max_tokens": 5, "messages": ASK, "thinking": {"type": "disabled", "budget_tokens": 2000}}, "budget_tokens"),
    ({"max_tokens": 5, "messages": ASK, "temperature": -1}, "temperature"),
])
def test_bad_requests_are_refused_in_anthropic_s_shape(tiny_tokenizer_dir: Path, body: dict, named: str) -> None:
    app, engine = _app(tiny_tokenizer_dir, ["never"])
    status, error = _error(app, {"model": MODEL, **body})
    assert status == 400, error
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert named in error["error"]["message"]
    assert not engine.prompts  # nothing reached the engine


def test_anthropic_s_error_shapes_and_keys(tiny_tokenizer_dir: Path) -> None:
    app, _ = _app(tiny_tokenizer_dir, ["ok"])
    status, error = _error(app, {"model": "other", "max_tokens": 5, "messages": ASK})
    assert status == 404 and error["error"]["type"] == "not_found_error"
    status, error = _error(app, {"model": MODEL, "max_tokens": 5, "messages": ASK}, headers={"x-api-key": "wrong"})
    assert status == 401 and error["error"]["type"] == "authentication_error"
    status, _ = _error(app, {"model": MODEL, "max_tokens": 5, "messages": ASK},
                       headers={"Authorization": f"Bearer {API_KEY}"})  # (what vLLM's clients send)
    assert status == 200
    status, error = _error(app, {"model": MODEL, "max_tokens": 5, "messages": ASK},
                           headers={"Authorization": "Bearer wrong", "x-api-key": API_KEY})
    assert status == 401  # a wrong bearer key is not rescued by another header
    status, error = _error(app, {"model": MODEL, "messages": ASK, "max_tokens": 5}, path="/v1/messages/count_tokens")
    assert status == 400 and "max_tokens" in error["error"]["message"]  # (not a count_tokens field)
    status, error = _error(app, {"model": MODEL, "max_tokens": 5, "messages": ASK}, path="/v1/completions")
    assert status == 400 and "error" in error and "type" not in error  # OpenAI's shape elsewhere


def test_an_error_after_the_stream_began_is_an_error_event(tiny_tokenizer_dir: Path) -> None:
    app, _ = _app(tiny_tokenizer_dir, ["Hello", " there", " friend"], fail_after=2)

    async def work(client: anthropic.AsyncAnthropic) -> None:
        async with client.messages.stream(model=MODEL, max_tokens=10, messages=ASK) as stream:
            async for _ in stream:
                pass
    with pytest.raises(anthropic.APIStatusError, match="engine is dead"):
        _run(app, work)


# ---- a live server of a real model ----

@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--enable-prompt-tokens-details", "--block-size", "16")) as live:
        yield live


def test_greedy_messages_equal_chat_completions(server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    expected = chat.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be kind."},
                                                                   *messages], max_tokens=24, temperature=0.0)
    whole = client.messages.create(model=MODEL, system="Be kind.", messages=messages, max_tokens=24, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, system="Be kind.", messages=messages, max_tokens=24,
                                extra_body=GREEDY) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    with client.messages.stream(model=MODEL, system="Be kind.", messages=messages, max_tokens=2,
                                extra_body=GREEDY) as stream:
        events = list(stream)
    # As vLLM: message_start leaves the cache fields out (not known yet), message_delta has them.
    assert events[0].message.usage.cache_read_input_tokens is None
    assert stream.get_final_message().usage.cache_read_input_tokens > 0
    assert whole.content[0].text == streamed_text == expected.choices[0].message.content
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == streamed.usage.output_tokens == 24
    prompt_tokens = expected.usage.prompt_tokens
    # With --enable-prompt-tokens-details the prefix-cached part is cache_read_input_tokens (Anthropic's sum).
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == prompt_tokens
    assert whole.usage.cache_read_input_tokens > 0  # (the chat request just cached this prompt's blocks)
    assert client.messages.count_tokens(model=MODEL, system="Be kind.", messages=messages).input_tokens == \
        prompt_tokens
    # A thinking budget (Anthropic's thinking "enabled" becomes one) needs the engine's reasoning
    # parser: vLLM's answer, naming the flag.
    with pytest.raises(openai.BadRequestError, match="--reasoning-parser"):
        chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                     extra_body={"thinking_token_budget": 10})


def test_tool_use_round_trip_on_a_live_server(server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    first = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    (call,) = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city", "days"} and 1 <= call.input["days"] <= 7
    second = client.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ASK, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}])
    assert second.usage.input_tokens > first.usage.input_tokens
    auto = client.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=[WEATHER])  # (hermes parses)
    assert auto.stop_reason == "max_tokens" and auto.content[0].type == "text"


def test_a_thinking_budget_is_forced_on_a_live_server(tiny_thinking_qwen3: Path,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """--reasoning-parser is the engine's too (vLLM's): a request's thinking_token_budget ends an
    open section with `</think>` after that many tokens (the engine's own tests: test_thinking_budget.py)."""
    with running_server(tiny_thinking_qwen3, tmp_path_factory.mktemp("thinking") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256", "--reasoning-parser", "qwen3")) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=API_KEY, max_retries=0)
        tokenizer = AutoTokenizer.from_pretrained(tiny_thinking_qwen3)
        end = tokenizer.convert_tokens_to_ids("</think>")
        prompt = [5, 17, 300, tokenizer.convert_tokens_to_ids("<think>")]
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={
            "thinking_token_budget": 2, "ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False})
        assert reply.choices[0].token_ids[2] == end
