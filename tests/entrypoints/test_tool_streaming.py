"""Streamed tool calls (tool_streaming.py): replies fed in small pieces give the arguments in
several pieces, as they are generated, that concatenate to the whole-text parser's calls."""

from __future__ import annotations

import json

import pytest

from vllm_lite.entrypoints.openai.serving_tools import ToolPlan, extract_tool_calls
from vllm_lite.entrypoints.openai.tool_streaming import ToolCallStream

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": [1, 2]}}; '
          '{"name": "get_time", "parameters": {"zone": "CET"}}')
MISTRAL = 'ok [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "f", "arguments": {}}]'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Os\\"lo}", "days": 2}}]'
NAMED = '{"city": "Paris", "days": 1}'
PYTHONIC = '[get_weather(city="Oslo", days=2)]'
GRANITE = 'Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}]'
GRANITE_31 = '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "f", "arguments": {}}]'
PHI4 = 'functools[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]'
JAMBA = 'ok <tool_calls>[{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_calls>'
LFM2 = 'Checking.<|tool_call_start|>[get_weather(city="Oslo", days=2)]<|tool_call_end|>'
GEMMA4 = 'Checking.<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|>'
QWEN3_XML = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n"
             "2\n</parameter>\n</function>\n</tool_call>")


def _stream(plan: ToolPlan, text: str, size: int) -> tuple[str, dict[int, str], dict[int, str], dict[int, int]]:
    stream = ToolCallStream(plan)
    content, names, arguments, pieces = "", {}, {}, {}
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    for i, chunk in enumerate(chunks):
        new_content, calls = stream.feed(chunk, final=i == len(chunks) - 1)
        content += new_content or ""
        for call in calls:
            if call.name is not None:
                assert call.index not in names, "a call is announced once"
                names[call.index] = call.name
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
            pieces[call.index] = pieces.get(call.index, 0) + 1
    return content, names, arguments, pieces


@pytest.mark.parametrize(("plan", "text", "incremental"), [
    (ToolPlan("auto", parser="hermes"), HERMES, True),
    (ToolPlan("auto", parser="qwen3"), HERMES, True),
    (ToolPlan("auto", parser="llama3_json"), LLAMA3, True),
    (ToolPlan("auto", parser="mistral"), MISTRAL, True),
    (ToolPlan("required"), REQUIRED, True),
    (ToolPlan("named", function_name="get_weather"), NAMED, True),
    (ToolPlan("auto", parser="pythonic"), PYTHONIC, False),
    (ToolPlan("auto", parser="granite"), GRANITE, True),
    (ToolPlan("auto", parser="granite"), GRANITE_31, True),
    (ToolPlan("auto", parser="phi4_mini_json"), PHI4, True),
    (ToolPlan("auto", parser="jamba"), JAMBA, True),
    (ToolPlan("auto", parser="lfm2"), LFM2, False),
    (ToolPlan("auto", parser="llama4_json"), LLAMA3, True),
    (ToolPlan("auto", parser="qwen3_json"), HERMES, True),
    (ToolPlan("auto", parser="qwen3_coder",
              schemas={"get_weather": {"properties": {"days": {"type": "integer"}}}}), QWEN3_XML, False),
    # text after the call blocks is content for these two (the whole reply's and the stream's alike)
    (ToolPlan("auto", parser="lfm2"), LFM2 + " Done.", False),
    (ToolPlan("auto", parser="gemma4"), GEMMA4 + " Done.", False),
    (ToolPlan("auto", parser="qwen3_coder"), QWEN3_XML + "\nI asked for Oslo.", False),
])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_calls_match_the_whole_text(plan: ToolPlan, text: str, incremental: bool, size: int) -> None:
    want_calls, want_content = extract_tool_calls(plan, text)
    content, names, arguments, pieces = _stream(plan, text, size)
    assert [names[i] for i in sorted(names)] == [c["function"]["name"] for c in want_calls]
    for index, call in enumerate(want_calls):
        assert json.loads(arguments[index]) == json.loads(call["function"]["arguments"])
        if incremental and len(call["function"]["arguments"]) > 2 * size + 2:
            assert pieces[index] > 2, "the arguments arrive in pieces, not at the end"
    assert (content.strip() or None) == (want_content.strip() if want_content else None)
    assert content == (want_content or "")


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "granite", "jamba", "lfm2", "phi4_mini_json", "gemma4"])
def test_plain_text_reply_is_all_content(parser: str) -> None:
    text = "No tool is needed: it is <b>sunny</b> {today}."
    content, names, _, _ = _stream(ToolPlan("auto", parser=parser), text, 2)
    assert content == text and not names


def test_unfinished_arguments_are_a_prefix_of_the_value() -> None:
    """A reply cut mid-arguments (max_tokens) has streamed only what was generated."""
    stream = ToolCallStream(ToolPlan("auto", parser="hermes"))
    _, calls = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', final=False)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]
    _, calls = stream.feed('ris"}}</tool', final=False)
    assert [(c.name, c.arguments) for c in calls] == [(None, 'ris"}')]
    assert json.loads(stream.arguments[0]) == {"city": "Paris"}


def test_a_partial_tag_is_held_back_from_content() -> None:
    stream = ToolCallStream(ToolPlan("auto", parser="hermes"))
    assert stream.feed("Sure.<tool_", final=False) == ("Sure.", [])
    content, calls = stream.feed('call>{"name": "f", "arguments": {}}</tool_call>', final=True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_arguments_given_as_a_json_string_arrive_at_the_end() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    content, names, arguments, _ = _stream(ToolPlan("auto", parser="hermes"), text, 3)
    assert names == {0: "f"} and json.loads(arguments[0]) == {"a": 1} and not content
