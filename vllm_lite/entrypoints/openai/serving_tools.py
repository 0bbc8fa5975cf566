"""Tool calling on /v1/chat/completions, as vLLM's server does it:

| tool_choice | what happens |
|---|---|
| none (or no tools) | plain text; the tools are still shown to the chat template |
| auto (the default with tools) | needs `--enable-auto-tool-choice` and `--tool-call-parser`: the model's text is parsed for calls |
| required | the output is constrained (grammar) to a JSON array of `{"name", "parameters"}`: the arguments always parse |
| {"type": "function", "function": {"name": f}} | the output is constrained to f's parameters schema |

`parallel_tool_calls: false` (vLLM's reading): at most one call, the first one parsed (with
"required", the array is constrained to one item).

Streaming sends content and each call's arguments as they are generated (tool_streaming.py);
the finish reason is decided on the whole text, as without streaming.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_lite.engine.request_checks import check_structured_outputs
from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, RequestParamError
from vllm_lite.entrypoints.openai.server_state import ServerOptions
from vllm_lite.entrypoints.openai.serving import ServingContext
from vllm_lite.entrypoints.openai.tool_parsers import (TOOL_PARSERS, ParsedToolCall, function_of,
                                                       parameters_schema, parse_required_calls,
                                                       required_calls_schema)
from vllm_lite.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    function_name: str | None = None
    parser: str | None = None
    parallel: bool = True  # False: at most one call
    # auto: each tool's parameters schema by function name (the parsers that type arguments read it)
    schemas: Mapping[str, Any] = field(default_factory=dict)

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """Each entry's function name; an entry that is not a function tool is a 400 naming `tools`."""
    try:
        return [function_of(tool)["name"] for tool in tools]
    except ValueError as exc:
        raise RequestParamError("tools", str(exc)) from None


def plan_tools(request: ChatCompletionRequest, options: ServerOptions) -> ToolPlan:
    tools, choice = request.tools, request.tool_choice
    _check(tools is None or len(tools) > 0, "tools", "`tools` must not be an empty array. Either provide at least "
           "one tool or omit the field entirely.")  # (vLLM's answer)
    if not tools:
        _check(choice in (None, "none"), "tool_choice", "tool_choice needs tools")
        return ToolPlan("none")
    names = tool_names(tools)
    if choice == "none":
        return ToolPlan("none")
    if choice is None or choice == "auto":
        _check(options.enable_auto_tool_choice and options.tool_call_parser is not None, "tool_choice",
               '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        return ToolPlan("auto", parser=options.tool_call_parser, parallel=request.parallel_tool_calls is not False,
                        schemas={function_of(tool)["name"]: parameters_schema(function_of(tool)) for tool in tools})
    if choice == "required":
        return ToolPlan("required", parallel=request.parallel_tool_calls is not False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    _check(isinstance(name, str), "tool_choice", "tool_choice must be none, auto, required or "
           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
    _check(name in names, "tool_choice", f"tool_choice names the function {name!r}, which is not in tools")
    return ToolPlan("named", function_name=name)


def chat_sampling(ctx: ServingContext, request: ChatCompletionRequest) -> tuple[SamplingParams, ToolPlan]:
    """A chat request's sampling params and tool plan (chat completions, Responses and Messages)."""
    params = request.to_sampling_params(ctx.vocab_size, ctx.sampling_defaults)
    plan = plan_tools(request, ctx.options)
    params = constrain(params, request, plan)
    markers = ctx.reasoning_special_markers + (ctx.tool_special_markers if plan.mode == "auto" else ())
    return keep_parser_markers(params, request, markers), plan


def keep_parser_markers(params: SamplingParams, request: ChatCompletionRequest,
                        markers: tuple[str, ...]) -> SamplingParams:
    """The reply detokenized with special tokens kept when a parser it goes through reads markers
    the tokenizer has as special tokens (Magistral's [THINK], Mistral's [TOOL_CALLS], ...):
    skipping them would hide every call and every thought (vLLM's parsers' adjust_request). An
    explicit skip_special_tokens: true cannot be honoured then, and is refused."""
    if not markers or not params.skip_special_tokens:
        return params
    _check(request.skip_special_tokens is None, "skip_special_tokens",
           f"skip_special_tokens: true would take {markers[0]}, a special token of this tokenizer, out of the "
           "reply before the server's parser reads it; leave the field unset")
    return params.clone_with(skip_special_tokens=False)


def constrain(params: SamplingParams, request: ChatCompletionRequest, plan: ToolPlan) -> SamplingParams:
    """required / named: the output must be the calls' JSON (a grammar on the request)."""
    if plan.mode not in ("required", "named"):
        return params
    _check(params.structured_outputs is None, "tool_choice",
           f'tool_choice "{plan.mode}" cannot be combined with response_format or structured_outputs')
    try:
        if plan.mode == "required":
            schema = required_calls_schema(request.tools, single=not plan.parallel)
        else:
            schema = parameters_schema(next(function_of(t) for t in request.tools
                                            if function_of(t)["name"] == plan.function_name))
        # Compact JSON: free whitespace adds nothing to arguments, and a weak model can spend its
        # whole budget on it.
        structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        check_structured_outputs(SamplingParams(structured_outputs=structured))
    except ValueError as exc:  # checked here so that the 400 names the tools
        raise RequestParamError("tools", f"the tools' parameters cannot constrain a {plan.mode} tool call: "
                                f"{exc}") from None
    return params.clone_with(structured_outputs=structured)


def extract_tool_calls(plan: ToolPlan, text: str) -> tuple[list[dict[str, Any]], str | None]:
    """(tool calls in OpenAI's shape, the remaining content) of one choice's finished text. As
    vLLM: a named call carries whatever was generated (none when nothing was), a required list
    cut by max_tokens is no call, and neither leaves content."""
    calls, content = _all_tool_calls(plan, text)
    return (calls if plan.parallel else calls[:1]), content


def _all_tool_calls(plan: ToolPlan, text: str) -> tuple[list[dict[str, Any]], str | None]:
    if plan.mode == "named":
        return ([ParsedToolCall(plan.function_name, text).to_openai()] if text.strip() else []), None
    if plan.mode == "required":
        try:
            return [call.to_openai() for call in parse_required_calls(text)], None
        except (ValueError, KeyError, TypeError):  # cut by max_tokens: not complete JSON
            return [], None
    if plan.mode == "auto":
        parsed = TOOL_PARSERS[plan.parser](text, plan.schemas)
        return [call.to_openai() for call in parsed.tool_calls], parsed.content
    return [], text


def forced_call_content(plan: ToolPlan, content: str | None) -> str | None:
    """A forced call's message has empty content, not null (vLLM's reply shape)."""
    return (content or "") if plan.mode in ("required", "named") else content


def finish_reason(plan: ToolPlan, calls: list[dict[str, Any]], reason: str | None) -> str | None:
    return "tool_calls" if calls and plan.mode in ("auto", "required") and reason == "stop" else reason


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise RequestParamError(param, message)
