"""The Responses API's request (`POST /v1/responses`) as vLLM serves it for non-harmony models,
turned into the chat completion request it runs as, and the output items of its answer.

| request field | becomes |
|---|---|
| input (a string, or message / function_call / function_call_output / reasoning items) | the chat messages after the stored conversation |
| instructions | a system message first (not carried over by previous_response_id, as OpenAI) |
| previous_response_id | the stored conversation of that response (its input and its output) |
| tools (`{"type": "function", "name", "parameters"}`), tool_choice | chat tools and tool_choice (serving_tools.py) |
| text.format (`json_schema`, `json_object`, `text`) | response_format (structured outputs) |
| include `["message.output_text.logprobs"]`, top_logprobs | logprobs, top_logprobs (on the message's output_text) |
| reasoning.effort | chat's reasoning_effort: the template's reasoning_effort, and enable_thinking = effort != "none" (as vLLM) |
| include_reasoning (vLLM's) | false: no reasoning item (nor logprobs) in the output |
| max_output_tokens, temperature, top_p, presence/frequency_penalty; vLLM's top_k, min_p, repetition_penalty, seed, stop, stop_token_ids, skip_special_tokens, include_stop_str_in_output, logit_bias, cache_salt, chat_template_kwargs | the chat fields of those names |
| store, stream, metadata, user, model | kept / echoed |

Fields this server cannot honour (`background`, other `include` values, `prompt`, `max_tool_calls`,
`truncation: auto`, `parallel_tool_calls: false`, hosted tools) and unknown fields are refused
with their name.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field

from vllm_lite.entrypoints.openai.protocol import (MAX_REQUEST_ID_CHARS, ChatCompletionRequest, OpenAIBaseModel,
                                                RequestParamError, TextRequest, unique_engine_id)
from vllm_lite.sampling_params import INT64_MAX, INT64_MIN

_INPUT_TEXT_PARTS = ("input_text", "output_text", "text")
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_REASONING_FIELDS = ("effort", "summary", "generate_summary")
# A chat field's error, in the Responses API's terms.
_RESPONSES_PARAM = {"max_completion_tokens": "max_output_tokens", "messages": "input"}


class ResponsesRequest(TextRequest):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default"] = "auto"
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: dict[str, Any] | None = None
    # Accepted only at the values that change nothing (refused by name otherwise).
    background: bool | None = False
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    truncation: Literal["disabled", "auto"] | None = "disabled"
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM's extras (the chat fields of the same names).
    include_reasoning: bool = True
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's: the response's id (and stored under it), else a new "resp_..." one.
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)  # vLLM's (as chat's)

    def ids(self) -> tuple[str, str]:
        """The response's id and the engine's request id: the caller's may be in use by another
        request in flight, so the engine's then adds a random suffix (the engine refuses duplicates)."""
        if self.request_id is None:
            response_id = new_id("resp")
            return response_id, response_id
        return self.request_id, unique_engine_id(self.request_id)

    def check_supported(self) -> None:
        """Unknown fields and values this server does not serve are refused, each by name."""
        unknown = self.unknown_fields()
        _check(not unknown, unknown[0] if unknown else "", f"unknown or unsupported field(s) for /v1/responses: "
               f"{', '.join(unknown)}")
        _check(self.store or not self.background, "background",
               "background can only be used when `store` is true")
        _check(not self.background, "background", "background responses are not supported")
        other = [item for item in self.include or [] if item != OUTPUT_LOGPROBS]
        _check(not other, "include", f"include supports only {OUTPUT_LOGPROBS!r}, got {other}")
        _check(self.top_logprobs is None or 0 <= self.top_logprobs <= 20, "top_logprobs",
               f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        _check(not self.top_logprobs or self.wants_logprobs(), "top_logprobs",  # (else dropped unread, as vLLM)
               f"top_logprobs needs include [{OUTPUT_LOGPROBS!r}], got {self.top_logprobs} without it")
        unknown = sorted(set(self.reasoning or {}) - set(_REASONING_FIELDS))
        _check(not unknown, f"reasoning.{unknown[0]}" if unknown else "reasoning",
               f"unsupported field(s) in reasoning: {unknown}")
        _check(self.reasoning_effort() is None or isinstance(self.reasoning_effort(), str), "reasoning.effort",
               f"reasoning.effort must be a string, got {self.reasoning_effort()!r}")
        _check(self.prompt is None, "prompt", "prompt templates are not supported")
        _check(self.max_tool_calls is None, "max_tool_calls", "max_tool_calls is not supported")
        _check(self.truncation in (None, "disabled"), "truncation", 'truncation must be "disabled" (a prompt '
               "longer than the context is refused)")
        _check(self.parallel_tool_calls in (None, True), "parallel_tool_calls",
               "parallel_tool_calls: false is not supported")
        _check(self.max_output_tokens is None or self.max_output_tokens >= 1, "max_output_tokens",
               f"max_output_tokens must be >= 1, got {self.max_output_tokens}")

    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])

    def reasoning_effort(self) -> Any:
        return (self.reasoning or {}).get("effort")

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request this runs as; `history` is the stored conversation of
        previous_response_id (its messages, in chat form)."""
        return ChatCompletionRequest(
            messages=[*self.instruction_messages(), *history, *self.input_messages()],
            max_completion_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, logit_bias=self.logit_bias, cache_salt=self.cache_salt, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            chat_template_kwargs=self.chat_template_kwargs, logprobs=self.wants_logprobs(), top_logprobs=(self.top_logprobs or 0) if self.wants_logprobs() else None,
            reasoning_effort=self.reasoning_effort(),
            tools=[_chat_tool(tool) for tool in self.tools] or None,
            tool_choice=_chat_tool_choice(self.tool_choice) if self.tools else _no_tools_choice(self.tool_choice),
            response_format=_response_format(self.text))

    def chat_error(self, exc: RequestParamError) -> RequestParamError:
        """An error of the chat request this runs as, naming the Responses API's field."""
        param = _RESPONSES_PARAM.get(exc.param, exc.param)
        if exc.param == "response_format":
            kind = ((self.text or {}).get("format") or {}).get("type")
            param = "text.format.schema" if kind == "json_schema" else "text.format"
        return RequestParamError(param, str(exc).replace("response_format", "text.format"))

    def instruction_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.instructions}] if self.instructions else []

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (consecutive function_call items are one assistant turn)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            _check(isinstance(item, dict), "input", f"input[{index}] must be an object")
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_input_message(item, index))
            elif kind == "function_call":
                call = _function_call(item, index)
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                _check(isinstance(item.get("call_id"), str) and isinstance(item.get("output"), str), "input",
                       f"input[{index}]: a function_call_output needs call_id and output strings")
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            elif kind != "reasoning":  # earlier reasoning is not shown to the model again (as vLLM)
                raise RequestParamError("input", f"input[{index}]: items of type {kind!r} are not supported "
                                        "(message, function_call, function_call_output, reasoning)")
        _check(bool(messages), "input", "input must hold at least one message")
        return messages


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise RequestParamError(param, message)


def _input_message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    _check(role in _MESSAGE_ROLES, "input", f"input[{index}].role must be one of {', '.join(_MESSAGE_ROLES)}, "
           f"got {role!r}")
    if isinstance(content, list):
        texts = []
        for part in content:
            _check(isinstance(part, dict) and part.get("type") in _INPUT_TEXT_PARTS
                   and isinstance(part.get("text"), str), "input",
                   f"input[{index}].content: only text parts are supported, got "
                   f"{part.get('type') if isinstance(part, dict) else type(part).__name__!r}")
            texts.append(part["text"])
        content = "\n".join(texts)
    _check(isinstance(content, str), "input", f"input[{index}].content must be text or a list of text parts")
    # Chat templates know system, not OpenAI's newer developer role.
    return {"role": "system" if role == "developer" else role, "content": content}


def _function_call(item: dict[str, Any], index: int) -> dict[str, Any]:
    fields = [item.get(name) for name in ("call_id", "name", "arguments")]
    _check(all(isinstance(value, str) for value in fields), "input",
           f"input[{index}]: a function_call needs call_id, name and arguments strings")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                    "arguments": item["arguments"]}}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    _check(isinstance(tool, dict) and tool.get("type") == "function", "tools",
           f"only function tools are supported, got a tool of type "
           f"{tool.get('type') if isinstance(tool, dict) else type(tool).__name__!r}")
    _check(isinstance(tool.get("name"), str), "tools", "a function tool needs a name")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        _check(choice in ("none", "auto", "required"), "tool_choice",
               f"tool_choice must be none, auto, required or {{'type': 'function', 'name': ...}}, got {choice!r}")
        return choice
    _check(choice.get("type") == "function" and isinstance(choice.get("name"), str), "tool_choice",
           f"tool_choice must be none, auto, required or {{'type': 'function', 'name': ...}}, got {choice!r}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _no_tools_choice(choice: str | dict[str, Any]) -> str | None:
    _check(choice in ("auto", "none"), "tool_choice", "tool_choice needs tools")
    return None


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format"})
    _check(not unknown, f"text.{unknown[0]}" if unknown else "text", f"unsupported field(s) in text: {unknown}")
    spec = text.get("format")
    if spec is None:
        return None
    _check(isinstance(spec, dict), "text.format", "text.format must be an object")
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec.get("schema"),
                                                       "strict": spec.get("strict")}}
    raise RequestParamError("text.format", f"text.format.type must be text, json_object or json_schema, got {kind!r}")


# --------------------------------------------------------------------------- output items


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str | None = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str | None, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text, logprobs)] if text is not None else []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue its conversation (the
    reasoning left out, as vLLM)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(part["text"] for part in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages
