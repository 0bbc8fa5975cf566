"""Tool calling: the parsers on known model outputs, tool_choice planning, templates that see
tool calls and results, and a live server through the official `openai` client (named and
required calls enforced by the grammar backend, auto calls parsed by the hermes parser,
parallel calls, streamed deltas, a multi-turn conversation with tool results), and the qwen3
reasoning parser (`<think>` text as `reasoning`, include_reasoning, reasoning_tokens) on the same
server."""

from __future__ import annotations

import json
import re
from typing import Any
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_server import LiveServer, running_server
from transformers import AutoTokenizer

from vllm_lite.entrypoints.openai.chat_template import render_chat_template
from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, RequestParamError
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.entrypoints.openai.reasoning_parsers import (ReasoningStream, ReasoningTokenCounter, split_reasoning,
                                                            think_tokens)
from vllm_lite.entrypoints.openai.serving_tools import plan_tools
from vllm_lite.entrypoints.openai.tool_parsers import TOOL_PARSERS, required_calls_schema
from vllm_lite.engine.request_checks import check_structured_outputs
from vllm_lite.sampling_params import SamplingParams, StructuredOutputsParams

MODEL = "tiny-qwen3"
API_KEY = "sk-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- parsers ----

@pytest.mark.parametrize(("parser", "text", "calls", "content"), [
    ("hermes", 'Let me see.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})], "Let me see."),
    ("hermes", "no calls here", [], "no calls here"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', [],
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}',
     [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})], None),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', [("get_time", {"zone": "UTC"})],
     None),
    ("pythonic", '[get_weather(city="Oslo", days=2), get_time(zone="UTC")]',
     [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})], None),
    ("pythonic", "[not a call", [], "[not a call"),
    ("granite", 'I will check. <|tool_call|>[{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     [("get_time", {"zone": "UTC"})], "I will check. "),
    ("granite", '<tool_call> [{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]',
     [("get_weather", {"city": "Rome", "days": 1})], None),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}]',
     [("get_weather", {"city": "Oslo", "days": [1, 2]})], None),  # (a nested array, unlike vLLM's regex)
    ("phi4_mini_json", "functools[not json", [], "functools[not json"),
    ("jamba", 'Sure <tool_calls>[{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_calls>',
     [("get_time", {"zone": "CET"})], "Sure "),
    ("lfm2", 'Let me see.<|tool_call_start|>[get_time(zone="UTC")]<|tool_call_end|> Done.',
     [("get_time", {"zone": "UTC"})], "Let me see. Done."),
    ("lfm2", "<|tool_call_start|>[broken(<|tool_call_end|>", [], "<|tool_call_start|>[broken(<|tool_call_end|>"),
    # Gemma 4's compact arguments: strings between <|"|>, bare JSON values, nested objects and lists
    ("gemma4", 'Let me see.<|tool_call>call:get_weather{city:<|"|>San Jose, CA<|"|>,days:2,units:{metric:true},'
               'tags:[<|"|>a<|"|>,1.5,null]}<tool_call|><|tool_call>call:get_time{zone:<|"|>UTC<|"|>}<tool_call|> Ok.',
     [("get_weather", {"city": "San Jose, CA", "days": 2, "units": {"metric": True}, "tags": ["a", 1.5, None]}),
      ("get_time", {"zone": "UTC"})], "Let me see. Ok."),
    ("gemma4", "<|tool_call>call:get_time{zone:<|\"|>UTC}<tool_call|>", [], "<|tool_call>call:get_time{zone:<|\"|>UTC}<tool_call|>"),
    ("gemma4", "no calls here", [], "no calls here"),
    ("llama4_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})], None),
    ("qwen3_json", '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
     [("get_time", {"zone": "UTC"})], None),
    # Qwen3-Coder's XML: values typed by the tool's schema (days: integer), one wrapping newline off
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", [("get_weather", {"city": "San Jose", "days": 3})],
     "I will check.\n"),
    ("qwen3_xml", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n"
     "</function>\n</tool_call> Done.", [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "12", "days": "soon"})],
     "\n Done."),  # (a string-typed "12" stays a string; "soon" is no integer: kept as text, as vLLM)
    ("qwen3_coder", "<function=unknown>\n<parameter=n>\n2\n</parameter>\n</function>", [("unknown", {"n": "2"})],
     None),  # (a bare <function=> without <tool_call>; a function the tools do not type: strings)
    ("qwen3_coder", "<tool_call>\nno function here\n</tool_call>", [],
     "<tool_call>\nno function here\n</tool_call>"),
])
def test_parsers(parser: str, text: str, calls: list, content: str | None) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    parsed = TOOL_PARSERS[parser](text, schemas)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert parsed.content == content


def test_required_schema_compiles() -> None:
    check_structured_outputs(SamplingParams(structured_outputs=StructuredOutputsParams(
        json=required_calls_schema(TOOLS))))


@pytest.mark.parametrize(("choice", "options", "words"), [
    ("auto", ServerOptions(), "--enable-auto-tool-choice"),
    ({"type": "function", "function": {"name": "nope"}}, ServerOptions(), "not in tools"),
    ("sometimes", ServerOptions(), "tool_choice must be"),
])
def test_bad_tool_choice(choice, options: ServerOptions, words: str) -> None:
    request = ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice=choice)
    with pytest.raises(RequestParamError, match=words):
        plan_tools(request, options)


def test_tool_calls_and_results_reach_the_template(tiny_qwen3: Path) -> None:
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    request = ChatCompletionRequest(messages=[
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ], tools=TOOLS)
    text = render_chat_template(AutoTokenizer.from_pretrained(tiny_qwen3), request.conversation(), max_chars=10_000,
                                timeout_s=5.0, chat_template=template, tools=request.tools)
    assert text == ("[tool get_weather][tool get_time]<user>What is the weather in Paris?"
                    "<assistant>get_weather(Paris)<tool>sunny, 21 C#call_1")


# ---- live server ----

@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _weather_ok(arguments: str) -> bool:
    value = json.loads(arguments, strict=False)
    return set(value) == {"city", "days"} and isinstance(value["city"], str) and 1 <= value["days"] <= 7


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_function(client: openai.OpenAI, temperature: float) -> None:
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150,
                                         temperature=temperature, seed=1,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop", message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    assert _weather_ok(call.function.arguments), call.function.arguments
    assert message.content == ""  # vLLM's reply shape for a forced call


def test_required_cut_by_max_tokens_has_no_call(client: openai.OpenAI) -> None:
    """As vLLM: a required list cut short is no call (tool_calls left out), content "", whole
    and streamed; a plain reply leaves empty tool_calls out too."""
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1, temperature=0.0,
                                         tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None and choice.message.content == ""
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1,
                                                 temperature=0.0, tool_choice="required", stream=True))
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert plain.choices[0].message.tool_calls is None


def test_required_streamed(client: openai.OpenAI) -> None:
    for seed in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                                temperature=1.0, seed=seed, tool_choice="required", stream=True)
        arguments: dict[int, str] = {}
        names: dict[int, str] = {}
        pieces: dict[int, int] = {}
        finish = None
        for chunk in stream:
            choice = chunk.choices[0]
            for call in choice.delta.tool_calls or []:
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
                pieces[call.index] = pieces.get(call.index, 0) + 1
                if call.function.name:
                    names[call.index] = call.function.name
            finish = choice.finish_reason or finish
        if finish == "length":
            continue  # cut mid-array: no calls can be parsed
        assert finish == "tool_calls" and names
        assert all(pieces[index] > 2 for index in names), "arguments are streamed as they are generated"
        for index, name in names.items():
            assert name in ("get_weather", "get_time")
            value = json.loads(arguments[index], strict=False)
            assert _weather_ok(arguments[index]) if name == "get_weather" else value["zone"] in ("UTC", "CET")


def test_auto_parallel_calls_parsed_by_hermes(client: openai.OpenAI) -> None:
    """The model's text is forced (a regex) into two hermes calls: both come back as calls."""
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=0.0,
            stream=stream, extra_body={"structured_outputs": {"regex": r"Sure\." + call + call}})
        if stream:
            chunks = list(response)
            deltas = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
            calls = [c for c in deltas if c.function.name]
            content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
            finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason]
            arguments = ["".join(d.function.arguments or "" for d in deltas if d.index == c.index) for c in calls]
            assert len(deltas) > 2 * len(calls), "arguments are streamed as they are generated"
        else:
            message = response.choices[0].message
            calls, content, finish = message.tool_calls, message.content, [response.choices[0].finish_reason]
            arguments = [c.function.arguments for c in calls]
        assert finish == ["tool_calls"]
        assert content == "Sure."
        assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
        assert all(_weather_ok(a) for a in arguments)


def test_parallel_tool_calls_false_keeps_the_first_call(client: openai.OpenAI) -> None:
    """vLLM's reading of `parallel_tool_calls: false` (LangChain's structured output through a
    tool sends it): the same forced two-call text gives one call, whole and streamed."""
    call = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    for stream in (False, True):
        response = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=0.0,
            stream=stream, parallel_tool_calls=False,
            extra_body={"structured_outputs": {"regex": r"Sure\." + call + call}})
        if stream:
            chunks = list(response)
            deltas = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
            assert {d.index for d in deltas} == {0}
            arguments = ["".join(d.function.arguments or "" for d in deltas)]
            names = [d.function.name for d in deltas if d.function.name]
        else:
            calls = response.choices[0].message.tool_calls
            arguments, names = [c.function.arguments for c in calls], [c.function.name for c in calls]
        assert names == ["get_weather"] and _weather_ok(arguments[0])


def test_parallel_tool_calls_false_constrains_required_to_one_call() -> None:
    """With tool_choice "required" the calls' array is constrained to one item (vLLM's maxItems)."""
    from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm_lite.entrypoints.openai.serving_tools import constrain, plan_tools

    def schema(parallel: bool | None) -> dict:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=parallel)
        plan = plan_tools(request, ServerOptions())
        return constrain(request.to_sampling_params(), request, plan).structured_outputs.json

    assert schema(False)["maxItems"] == 1 and schema(False)["minItems"] == 1
    assert "maxItems" not in schema(True) and "maxItems" not in schema(None)


def test_multi_turn_with_tool_results(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                            temperature=0.0, tool_choice="none")
    assert second.choices[0].message.tool_calls in (None, [])
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the tool result is in the prompt


def test_tool_choice_conflicts_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8,
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


# ---- reasoning parser ----

@pytest.mark.parametrize(("parser", "text", "want"), [
    ("qwen3", "<think>\nhmm</think>\n\nAnswer", ("\nhmm", "Answer")),
    ("qwen3", "plain <think> text", (None, "plain <think> text")),
    ("qwen3", "<think>cut short", ("cut short", None)),
    ("deepseek_r1", "hmm</think>Answer", ("hmm", "Answer")),
    ("deepseek_r1", "<think>hmm</think>", ("hmm", None)),
    ("mistral", "[THINK]hmm[/THINK]Answer", ("hmm", "Answer")),
    ("mistral", "Answer [THINK] later", (None, "Answer [THINK] later")),
    ("mistral", "[THINK]cut", ("cut", None)),
    ("granite", "Here is my thought process: hmm Here is my response: Answer", (" hmm ", " Answer")),
    ("granite", "Here's my thought process:\nhmm\nHere's my response:\nAnswer", ("\nhmm\n", "Answer")),
    ("granite", "Here is my thought process: cut", (" cut", None)),
    ("granite", "Just an answer. Here is my response: no", (None, "Just an answer. Here is my response: no")),
    # Gemma 4: its channel markers, the "thought" label after the opener not reasoning
    ("gemma4", "<|channel>thought\nhmm<channel|>Answer", ("hmm", "Answer")),
    ("gemma4", "<|channel>thou", (None, None)),
    ("gemma4", "<|channel>though it rains", ("though it rains", None)),
    ("gemma4", "Answer", (None, "Answer")),
])
def test_reasoning_split_whole_and_streamed(parser: str, text: str, want: tuple) -> None:
    assert split_reasoning(parser, text) == want
    for size in (1, 2, 5):
        stream, reasoning, content = ReasoningStream(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, c = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + (r or ""), content + (c or "")
        assert (reasoning or None, content or None) == want, size


REASONING_REGEX = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,3}</think>\n\n[A-Z][a-z]{2,8}"


def _reasoning_reply(client: openai.OpenAI, stream: bool, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, temperature=0.0, stream=stream,
                                          stream_options={"include_usage": True} if stream else None,
                                          extra_body={"structured_outputs": {"regex": REASONING_REGEX}, **extra})


def test_reasoning_served(client: openai.OpenAI) -> None:
    """vLLM's field name (`reasoning`), whole and streamed, and its usage detail."""
    out = _reasoning_reply(client, stream=False)
    message = out.choices[0].message
    reasoning, content = message.model_extra["reasoning"], message.content
    assert "reasoning_content" not in message.model_extra
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){0,3}", reasoning) and re.fullmatch(r"[A-Z][a-z]{2,8}", content)
    # the tiny tokenizer has no <think> token: no token counts as reasoning (as vLLM counts)
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(_reasoning_reply(client, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 0


def test_include_reasoning_false_hides_the_reasoning(client: openai.OpenAI) -> None:
    """vLLM's include_reasoning: false: the same content, no reasoning (nor the logprobs and
    token ids that would show it), whole and streamed."""
    shown = _reasoning_reply(client, stream=False).choices[0].message
    out = _reasoning_reply(client, stream=False, include_reasoning=False, logprobs=True, return_token_ids=True)
    choice = out.choices[0]
    assert choice.message.content == shown.content and "reasoning" not in choice.message.model_extra
    assert choice.logprobs is None and (choice.model_extra or {}).get("token_ids") is None
    chunks = list(_reasoning_reply(client, stream=True, include_reasoning=False))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any((d.model_extra or {}).get("reasoning") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == shown.content


def test_reasoning_markers_by_parser(tiny_tokenizer_dir: Path) -> None:
    """Mistral's [THINK] / [/THINK] are looked up as tokens; granite's markers are text, so it
    counts no reasoning tokens and takes no thinking budget."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    tokens = think_tokens(tokenizer, "mistral")
    assert tokens is not None and tokenizer.convert_ids_to_tokens([tokens.start, tokens.end]) == ["[THINK]", "[/THINK]"]
    assert think_tokens(tokenizer, "qwen3") is None and think_tokens(tokenizer, "granite") is None
    assert ReasoningTokenCounter.for_parser("mistral", tokens).feed([tokens.start, 11, 12, tokens.end, 13]) == 2


def test_reasoning_tokens_are_counted_between_think_tokens(tiny_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert think_tokens(tokenizer) is None
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokens = think_tokens(tokenizer)
    assert tokens is not None and tokenizer.convert_ids_to_tokens([tokens.start, tokens.end]) == ["<think>", "</think>"]
    reply = [tokens.start, 11, 12, 13, tokens.end, 14, tokens.start, 15, tokens.end]
    qwen3 = ReasoningTokenCounter.for_parser("qwen3", tokens)
    assert [qwen3.feed(reply[i:i + 2]) for i in range(0, len(reply), 2)][-1] == 3  # fed in pieces
    assert ReasoningTokenCounter.for_parser("deepseek_r1", tokens).feed([11, 12, tokens.end, 13]) == 2
    assert ReasoningTokenCounter.for_parser("qwen3", tokens).feed([11, 12, 13]) == 0  # no <think>
    assert ReasoningTokenCounter.for_parser("qwen3", None).feed(reply) == 0


def test_reasoning_effort_becomes_template_kwargs() -> None:
    """vLLM's rule: reasoning_effort reaches the template with enable_thinking = effort != "none",
    unless chat_template_kwargs sets enable_thinking itself."""
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**base).template_kwargs() is None
    assert ChatCompletionRequest(**base, reasoning_effort="none").template_kwargs() == \
        {"reasoning_effort": "none", "enable_thinking": False}
    assert ChatCompletionRequest(**base, reasoning_effort="high",
                                 chat_template_kwargs={"enable_thinking": False, "x": 1}).template_kwargs() == \
        {"reasoning_effort": "high", "enable_thinking": False, "x": 1}


UNIT = {"title": "Unit", "type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER_WITH_DEFS = {"type": "function", "function": {
    "name": "get_weather_in", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["city", "unit"], "additionalProperties": False, "$defs": {"Unit": UNIT}}}}


def test_required_with_defs_references_is_served(client: openai.OpenAI) -> None:
    """A tool whose parameters use $defs / $ref (pydantic's output) works with "required": its
    definitions resolve at the root of the calls' schema, as in vLLM; the request's tool is kept."""
    tools = [WEATHER_WITH_DEFS, TIME]
    before = json.dumps(tools, sort_keys=True)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                         max_tokens=120, temperature=0.0)
    assert json.dumps(tools, sort_keys=True) == before
    calls = out.choices[0].message.tool_calls or []
    assert out.choices[0].finish_reason == "length" or calls
    for call in calls:
        args = json.loads(call.function.arguments, strict=False)
        if call.function.name == "get_weather_in":
            assert set(args) == {"city", "unit"} and args["unit"] in UNIT["enum"]
    schema = required_calls_schema(tools)
    assert schema["$defs"] == {"Unit": UNIT} and "$defs" in tools[0]["function"]["parameters"]
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": {"type": "integer"}}}}}
    with pytest.raises(openai.BadRequestError, match=r"\$defs/Unit") as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_WITH_DEFS, clash],
                                       tool_choice="required", max_tokens=4)
    assert info.value.body["param"] == "tools"


@pytest.mark.parametrize(("value", "schema", "expected"), [
    ("2.5", {"type": "number"}, 2.5), ("4.0", {"type": "number"}, 4), ("true", {"type": "boolean"}, True),
    ("0", {"type": "bool"}, False), ("null", {"type": ["string", "null"]}, None), ("x", {"type": ["integer", "null"]}, "x"),
    ('[1, "a"]', {"type": "array"}, [1, "a"]), ('{"k": 1}', {"type": "object"}, {"k": 1}),
    ("1e999", {"type": "number"}, "1e999"), ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
    ("2", {"enum": [1, 2, 3]}, 2), ("5", {"description": "no type"}, "5"), ("[1]", {"type": "string"}, "[1]"),
])
def test_qwen3_coder_values_take_the_schemas_type(value: str, schema: dict, expected) -> None:
    """vLLM's coercion of a Qwen3-Coder parameter's text by its schema: the first of the schema's
    types (null, integer, number, boolean, object, array, string) the text reads as."""
    text = f"<tool_call>\n<function=f>\n<parameter=p>\n{value}\n</parameter>\n</function>\n</tool_call>"
    schemas = {"f": {"type": "object", "properties": {"p": schema}}}
    (call,) = TOOL_PARSERS["qwen3_coder"](text, schemas).tool_calls
    assert json.loads(call.arguments) == {"p": expected}
