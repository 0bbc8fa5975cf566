"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`) as
vLLM serves it, turned into the chat completion request it runs as:

| request field | becomes |
|---|---|
| system (a string or text blocks) | a system message first; Claude Code's `x-anthropic-billing-header` block is left out (vLLM's: its per-request hash would defeat prefix caching) |
| messages: user / assistant turns of text, tool_use, tool_result, thinking blocks | chat messages: tool_use -> the assistant's tool_calls, tool_result -> a tool message (its text blocks joined by newlines), thinking -> the assistant's reasoning (vLLM's: the template reads it as reasoning / reasoning_content); redacted_thinking is left out (opaque, as vLLM) |
| messages of role system (vLLM's extension) | system messages where they are, or merged into the leading one when the chat template takes no system message after the first (vLLM's rule) |
| max_tokens, stop_sequences, temperature, top_p, top_k | max_completion_tokens, stop, temperature, top_p, top_k |
| tools (name, description, input_schema, strict) | chat function tools |
| tool_choice auto / any / tool / none, disable_parallel_tool_use | tool_choice auto / required / named / none, parallel_tool_calls false |
| thinking: enabled / disabled / adaptive | budget_tokens as vLLM's thinking_token_budget (needs --reasoning-parser) / reasoning_effort "none" (the template's enable_thinking false) / nothing pinned (as vLLM); display "omitted": thinking blocks without their text ("summarized": the whole text, as vLLM) |
| output_config: format (json_schema), effort | response_format json_schema, reasoning_effort |
| metadata, cache_control (top level and on blocks), service_tier, a tool_result's is_error | accepted: nothing the output depends on (prefix caching is automatic; an error result's text is its content) |
| vLLM's cache_salt, chat_template_kwargs, vllm_xargs | chat's |

Image blocks (base64 or url sources) become chat's `image_url` parts (a model that takes images:
README "Image inputs"; any other refuses them by name). What cannot be honoured is refused by name:
document blocks,
citations, server tools (web search, code execution, ...), deferred tools and tool changes, and
unknown fields (mcp_servers, container, context_management, ...).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from vllm_lite.entrypoints.openai.protocol import ChatCompletionRequest, RequestModel, RequestParamError, VllmXargs

BILLING_HEADER = "x-anthropic-billing-header"
_ROLES = ("user", "assistant", "system")
_CONTENT_KEYS = {
    "text": {"text", "cache_control", "citations"},
    "tool_use": {"id", "name", "input", "cache_control"},
    "tool_result": {"tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"thinking", "signature"},
    "redacted_thinking": {"data"},
    "image": {"source", "cache_control"},
}
_TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "strict", "type", "defer_loading",
              "input_examples"}
_EFFORTS = ("low", "medium", "high", "xhigh", "max")


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error object (errors.anthropic_error_body writes it)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


class AnthropicConversation(RequestModel):
    """The fields a Messages request and a count_tokens request share: the conversation."""

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # vLLM's extension
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_fields(self, merge_inline_system: bool) -> dict[str, Any]:
        """The chat request's conversation fields. `merge_inline_system`: the template takes no
        system message after the first, so those join the leading one."""
        system = _system_texts(self.system, "system")
        messages: list[dict[str, Any]] = []
        for index, message in enumerate(self.messages):
            where = f"messages[{index}]"
            _check(isinstance(message, dict), where, f"{where} must be an object")
            role = message.get("role")
            _check(role in _ROLES, f"{where}.role", f"{where}.role must be user or assistant, got {role!r}")
            unknown = sorted(set(message) - {"role", "content"})
            _check(not unknown, f"{where}.{unknown[0] if unknown else ''}", f"unknown field(s) in {where}: {unknown}")
            if role == "system":
                texts = _system_texts(message.get("content"), f"{where}.content")
                if merge_inline_system:
                    system += texts
                elif texts:
                    messages.append({"role": "system", "content": "".join(texts)})
                continue
            messages += _chat_messages(role, message.get("content"), where)
        _check(bool(messages), "messages", "messages must hold at least one user or assistant message")
        fields: dict[str, Any] = {
            "messages": ([{"role": "system", "content": "".join(system)}] if system else []) + messages,
            "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning_effort": self._reasoning_effort(),
            "response_format": self._response_format(),
        }
        if self.tools:  # (an empty list: no tools, as Anthropic reads it)
            fields["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(self.tools)]
        fields.update(self._tool_choice())
        return fields

    def _reasoning_effort(self) -> str | None:
        effort = (self.output_config or {}).get("effort")
        _check(effort is None or effort in _EFFORTS, "output_config.effort",
               f"output_config.effort must be one of {', '.join(_EFFORTS)}, got {effort!r}")
        if self.thinking is None:
            return effort
        kind = self.thinking.get("type")
        unknown = sorted(set(self.thinking) - {"type", "budget_tokens", "display"})
        _check(not unknown, f"thinking.{unknown[0] if unknown else ''}", f"unknown field(s) in thinking: {unknown}")
        _check(kind in ("enabled", "disabled", "adaptive"), "thinking.type",
               f"thinking.type must be enabled, disabled or adaptive, got {kind!r}")
        _check(kind == "enabled" or "budget_tokens" not in self.thinking, "thinking.budget_tokens",
               f"thinking.budget_tokens belongs to thinking of type 'enabled', not {kind!r}")
        _check(self.thinking.get("display") in (None, "summarized", "omitted"), "thinking.display",
               f"thinking.display must be summarized or omitted, got {self.thinking.get('display')!r}")
        return "none" if kind == "disabled" else effort

    def thinking_budget(self, max_tokens: int | None) -> int | None:
        """thinking of type "enabled": its budget_tokens, vLLM's thinking_token_budget (at least
        1,024 and less than max_tokens, as Anthropic and vLLM ask)."""
        if (self.thinking or {}).get("type") != "enabled":
            return None
        budget = self.thinking.get("budget_tokens")
        _check(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1024,
               "thinking.budget_tokens", f"thinking.budget_tokens must be an integer >= 1024, got {budget!r}")
        _check(max_tokens is None or budget < max_tokens, "thinking.budget_tokens",
               "thinking.budget_tokens must be less than max_tokens")
        return budget

    def omits_thinking(self) -> bool:
        """thinking.display "omitted": thinking blocks carry their signature, not their text."""
        return (self.thinking or {}).get("display") == "omitted"

    def _response_format(self) -> dict[str, Any] | None:
        config = self.output_config or {}
        unknown = sorted(set(config) - {"effort", "format"})
        _check(not unknown, f"output_config.{unknown[0] if unknown else ''}",
               f"unknown field(s) in output_config: {unknown}")
        spec = config.get("format")
        if spec is None:
            return None
        _check(isinstance(spec, dict) and spec.get("type") == "json_schema" and isinstance(spec.get("schema"), dict),
               "output_config.format", "output_config.format must be {'type': 'json_schema', 'schema': {...}}")
        unknown = sorted(set(spec) - {"type", "schema"})
        _check(not unknown, "output_config.format", f"unknown field(s) in output_config.format: {unknown}")
        return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": spec["schema"]}}

    def _tool_choice(self) -> dict[str, Any]:
        choice = self.tool_choice
        if choice is None:
            return {"tool_choice": "auto" if self.tools else None}
        kind = choice.get("type")
        unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
        _check(not unknown, "tool_choice", f"unknown field(s) in tool_choice: {unknown}")
        fields: dict[str, Any] = {"parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}
        if kind in ("auto", "none"):
            fields["tool_choice"] = kind if self.tools else None
        elif kind == "any":
            fields["tool_choice"] = "required"
        elif kind == "tool":
            _check(isinstance(choice.get("name"), str), "tool_choice.name", "tool_choice of type 'tool' needs a name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise RequestParamError("tool_choice.type", f"tool_choice.type must be auto, any, tool or none, "
                                    f"got {kind!r}")
        return fields


class AnthropicMessagesRequest(AnthropicConversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # (user_id: for Anthropic's abuse detection)
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None  # (a prompt-caching mark: caching here is automatic)
    # vLLM's extension
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    vllm_xargs: VllmXargs | None = None  # (chat's)

    def chat_request(self, merge_inline_system: bool) -> ChatCompletionRequest:
        """The chat completion request this runs as."""
        return ChatCompletionRequest(
            model=self.model, max_completion_tokens=self.max_tokens, stop=self.stop_sequences,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, cache_salt=self.cache_salt,
            vllm_xargs=self.vllm_xargs, thinking_token_budget=self.thinking_budget(self.max_tokens), **self.chat_fields(merge_inline_system))


class AnthropicCountTokensRequest(AnthropicConversation):
    def chat_request(self, merge_inline_system: bool) -> ChatCompletionRequest:
        self.thinking_budget(None)  # (checked: the count does not depend on it)
        return ChatCompletionRequest(model=self.model, **self.chat_fields(merge_inline_system))


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise RequestParamError(param, message)


def _system_texts(content: Any, where: str) -> list[str]:
    """A system prompt's texts (a string, or text blocks), without Claude Code's billing header."""
    if content is None:
        return []
    texts = [content] if isinstance(content, str) else [_text_block(block, f"{where}[{i}]")
                                                        for i, block in enumerate(_blocks(content, where))]
    return [text for text in texts if text and not text.startswith(BILLING_HEADER)]


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    _check(isinstance(content, list) and all(isinstance(block, dict) for block in content), where,
           f"{where} must be a string or a list of content blocks")
    return content


def _block_kind(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind not in _CONTENT_KEYS:
        what = "documents" if kind == "document" else f"{kind!r} blocks"
        raise RequestParamError(f"{where}.type", f"{where}: {what} are not supported by vllm_lite (text, image, "
                                "tool_use, tool_result, thinking and redacted_thinking blocks are)")
    unknown = sorted(set(block) - _CONTENT_KEYS[kind] - {"type"})
    _check(not unknown, f"{where}.{unknown[0] if unknown else ''}", f"unknown field(s) in {where}: {unknown}")
    return kind


def _text_block(block: dict[str, Any], where: str) -> str:
    _check(_block_kind(block, where) == "text" and isinstance(block.get("text"), str), where,
           f"{where} must be a text block")
    _check(not block.get("citations"), f"{where}.citations", "citations are not supported")
    return block["text"]


def _chat_messages(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results are tool messages (before
    the rest of its text, as the results answer the previous turn's calls)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # the text and image blocks as chat's content parts, in order
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, block in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{index}]"
        kind = _block_kind(block, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "image" and role == "user":
            parts.append(_image_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            tool_messages.append(_tool_message(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking":
                _check(isinstance(block.get("thinking"), str), f"{at}.thinking", f"{at}.thinking must be a string")
                reasoning.append(block["thinking"])
        else:
            raise RequestParamError(f"{at}.type", f"{at}: a {kind} block cannot be in a {role} message")
    message: dict[str, Any] = {"role": role}
    if len(parts) == 1 and parts[0]["type"] == "text":  # (one text: a string, as chat takes it)
        message["content"] = parts[0]["text"]
    elif parts:
        message["content"] = parts
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if len(message) == 1:  # (only tool results, or nothing)
        return tool_messages
    message.setdefault("content", None if role == "assistant" else "")
    return tool_messages + [message]


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as chat's `image_url` part (base64 data as a data URL)."""
    source = block.get("source")
    _check(isinstance(source, dict), f"{where}.source", f"{where}: an image block needs a source object")
    kind = source.get("type")
    if kind == "base64":
        _check(isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str),
               f"{where}.source", f"{where}.source: a base64 image needs media_type and data strings")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url":
        _check(isinstance(source.get("url"), str), f"{where}.source.url", f"{where}.source.url must be a string")
        url = source["url"]
    else:
        raise RequestParamError(f"{where}.source.type", f"{where}.source: images of source type {kind!r} are not "
                                "supported by vllm_lite (base64 and url are)")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    _check(isinstance(block.get("id"), str) and isinstance(block.get("name"), str), where,
           f"{where}: a tool_use block needs an id and a name")
    arguments = block.get("input", {})
    _check(isinstance(arguments, dict), f"{where}.input", f"{where}.input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments)}}


def _tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    _check(isinstance(block.get("tool_use_id"), str), f"{where}.tool_use_id",
           f"{where}: a tool_result block needs its tool_use_id")
    content = block.get("content") or ""
    if not isinstance(content, str):
        content = "\n".join(_text_block(part, f"{where}.content[{i}]")
                            for i, part in enumerate(_blocks(content, f"{where}.content")))
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    _check(isinstance(tool, dict), where, f"{where} must be an object")
    kind = tool.get("type", "custom")
    _check(kind == "custom", f"{where}.type", f"{where}: server tools ({kind!r}) are not supported by vllm_lite: "
           "only client tools (name, description, input_schema)")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    _check(not unknown, f"{where}.{unknown[0] if unknown else ''}", f"unknown field(s) in {where}: {unknown}")
    _check(isinstance(tool.get("name"), str) and isinstance(tool.get("input_schema"), dict), where,
           f"{where} needs a name and an input_schema object")
    _check(not tool.get("defer_loading"), f"{where}.defer_loading", "deferred tools are not supported")
    _check(not tool.get("input_examples"), f"{where}.input_examples", "input_examples are not supported")
    schema = {"type": "object", **tool["input_schema"]}
    function = {"name": tool["name"], "parameters": schema}
    for key in ("description", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}
