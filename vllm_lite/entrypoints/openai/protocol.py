"""Request and response bodies of the OpenAI-compatible API, in OpenAI's JSON shapes.

Requests carry OpenAI's fields plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...) and convert themselves to `SamplingParams`,
which does the range checks (its ValueErrors name the field and become 400 responses).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_lite.entrypoints.openai.structured_outputs import (LEGACY_FIELDS, StructuredFieldError,
                                                             structured_outputs_from_fields)
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# The largest `logprobs` OpenAI accepts on /v1/completions and `top_logprobs` on chat.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _omit_if_none(value: Any) -> bool:
    return value is None


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted (clients send fields of newer API versions) and reported in
    # the server log, as vLLM does.
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- requests

# Request fields passed to SamplingParams under the same name when set.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias",
                    "seed", "stop", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _GenerationRequest(OpenAIBaseModel):
    """Fields completions and chat completions share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, description=(
        "vLLM's prefix-cache salt: requests share cached prompt blocks only with requests of the same salt"))
    # Structured outputs (see structured_outputs.py): OpenAI's response_format, vLLM's
    # structured_outputs and its legacy guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         max_tokens_field: str = "max_tokens") -> SamplingParams:
        """Unset fields keep SamplingParams' defaults; the server reads outputs as deltas.
        `max_tokens_field` is the request field `max_tokens` came from (named in errors)."""
        _check(max_tokens is None or max_tokens >= 1, max_tokens_field,
               f"{max_tokens_field} must be >= 1, got {max_tokens}")
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        kwargs = {name: value for name, value in given.items() if value is not None}
        _check(self.stream_options is None or self.stream, "stream_options",
               "stream_options is only allowed when stream is true")
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs,
                              output_kind=RequestOutputKind.DELTA,
                              structured_outputs=self._structured_outputs())

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        _check(self.guided_whitespace_pattern is None, "guided_whitespace_pattern",
               "guided_whitespace_pattern is not supported")
        legacy = {name: getattr(self, name) for name in LEGACY_FIELDS if getattr(self, name) is not None}
        try:
            return structured_outputs_from_fields(self.response_format, self.structured_outputs, legacy,
                                                  self.guided_decoding_backend)
        except StructuredFieldError as exc:
            raise RequestParamError(exc.param, str(exc)) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS, "logprobs",
               f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}")
        _check(self.best_of is None or self.best_of == self.n, "best_of",
               f"best_of must equal n (other values are not supported), got {self.best_of}")
        _check(self.suffix is None, "suffix", "suffix is not supported")
        _check(not (self.echo and self.logprobs is not None), "echo",
               "echo together with logprobs is not supported")
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a `tool` turn: the call it answers

    def text(self) -> str:
        """The message's text; content parts must all be text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            _check(part.get("type") == "text" and isinstance(part.get("text"), str), "messages",
                   f"only text content parts are supported, got a part of type {part.get('type')!r}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    # vLLM's extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        _check(bool(self.messages), "messages", "messages must hold at least one message")
        _check(self.top_logprobs is None or self.logprobs, "top_logprobs",
               "top_logprobs needs logprobs=true")
        _check(self.top_logprobs is None or 0 <= self.top_logprobs <= MAX_CHAT_TOP_LOGPROBS,
               "top_logprobs", f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(not (self.add_generation_prompt and self.continue_final_message), "continue_final_message",
               "continue_final_message and add_generation_prompt cannot both be true")
        if self.max_completion_tokens is not None:
            max_tokens, field = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = self.max_tokens, "max_tokens"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, field)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them (tool calls' arguments as objects, as the
        templates of Qwen, Llama and Hermes expect)."""
        return [_template_message(m) for m in self.messages]


def _template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except ValueError:
                    raise RequestParamError("messages", "tool_calls[].function.arguments must be JSON text, "
                                            f"got {arguments[:80]!r}") from None
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


class TokenizeRequest(OpenAIBaseModel):
    """`prompt` (completions-style) or `messages` (chat-style, the chat template applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class RequestParamError(ValueError):
    """An invalid request field; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise RequestParamError(param, message)


# --------------------------------------------------------------------------- responses


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_if_none)


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_if_none)  # --reasoning-parser
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = Field(default=None, exclude_if=_omit_if_none)
    content: str | None = Field(default=None, exclude_if=_omit_if_none)
    reasoning_content: str | None = Field(default=None, exclude_if=_omit_if_none)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_omit_if_none)


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_if_none)


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllm_lite"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
