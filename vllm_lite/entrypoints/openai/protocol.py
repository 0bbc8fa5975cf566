"""Request and response bodies of the OpenAI-compatible API, in OpenAI's JSON shapes.

Requests carry OpenAI's fields plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...) and convert themselves to `SamplingParams`,
which does the range checks (its ValueErrors name the field and become 400 responses).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from vllm_lite.entrypoints.beam_search import BeamSearchParams
from vllm_lite.engine.input_processor import check_utf8
from vllm_lite.entrypoints.chat_content import content_texts
from vllm_lite.entrypoints.openai.structured_outputs import (LEGACY_FIELDS, StructuredFieldError,
                                                             structured_outputs_from_fields)
from vllm_lite.sampling_params import (ALL_VOCAB_LOGPROBS, INT64_MAX, INT64_MIN, MAX_LOGPROB_TOKEN_IDS,
                                       RequestOutputKind, SamplingParams, StructuredOutputsParams)

MAX_REQUEST_ID_CHARS = 256  # a caller's request id (body or X-Request-Id header)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, header: str | None, given: str | None) -> tuple[str, str]:
    """The response's id and the engine's request id of a request: vLLM's rule for the first
    (the X-Request-Id header's id, else the body's `request_id`, else a new one, after the
    endpoint's prefix). A caller's id may be in use by another request in flight, so the engine's
    id then adds a random suffix (the engine refuses a duplicate)."""
    chosen = header if header is not None else given
    if chosen is None:
        response_id = random_id(prefix)
        return response_id, response_id
    _check(0 < len(chosen) <= MAX_REQUEST_ID_CHARS, "request_id" if header is None else "X-Request-Id",
           f"a request id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(chosen)}")
    response_id = f"{prefix}-{chosen}"
    return response_id, unique_engine_id(response_id)


def unique_engine_id(response_id: str) -> str:
    """The engine's id for a response whose id the caller chose (it may be in flight twice)."""
    return f"{response_id}-{uuid.uuid4().hex[:12]}"


def _now() -> int:
    return int(time.time())


def _omit_if_none(value: Any) -> bool:
    return value is None


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (model_extra): a request body refuses them (RequestModel), nested
    # objects such as chat messages carry fields of newer API versions that no result depends on.
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# Request fields vLLM's server accepts that vllm_lite does not implement: refused by name (a
# field that changes the result is never dropped), unless given with the value that changes
# nothing (vLLM's default, in _NO_OP_VALUES). Other unknown fields are refused as unknown.
VLLM_FIELDS_NOT_IMPLEMENTED = frozenset((
    # (spaces_between_special_tokens and repetition_detection are served on completions and chat,
    # prompt_embeds on completions: declared fields there; refused here on the other routes)
    "spaces_between_special_tokens", "repetition_detection", "prompt_embeds",
    "mm_processor_kwargs", "logits_processors", "kv_transfer_params",
    "return_tokens_as_token_ids_format", "media_io_kwargs",
    "functions", "function_call", "audio", "modalities", "web_search_options"))
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "spaces_between_special_tokens": (True,),
    "logits_processors": (None, []), "mm_processor_kwargs": (None, {}),
    "modalities": (None, ["text"]), "audio": (None,),  # (a text reply: what is served)
}


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, BaseModel):  # nested objects (chat messages, their parts, tools)
        yield from _strings(value.__dict__)
        yield from _strings(value.model_extra or {})


class TextRequest(OpenAIBaseModel):
    """A request body whose every string, however deep, is text (no unpaired surrogate from a
    JSON escape such as "\\ud83d"): refused by field here rather than by a tokenizer or encoder later."""

    @field_validator("*", mode="after")
    @classmethod
    def _text_is_utf8(cls, value: Any, info: ValidationInfo) -> Any:
        for text in _strings(value):
            check_utf8(text, info.field_name or "body")
        return value


class NullsAsDefaults(BaseModel):
    """A body whose fields in `nulls_as_defaults` take a JSON null as their default, as vLLM's
    do (OpenAI's clients and frameworks send null for fields they do not set)."""

    nulls_as_defaults: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.nulls_as_defaults):
            return {key: value for key, value in data.items() if value is not None or key not in cls.nulls_as_defaults}
        return data


class RequestModel(TextRequest):
    """A request body: a top-level field it does not define is refused with a 400 naming it
    (`refuse_unknown_fields`); the schema says so (additionalProperties: false)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})
    no_op_values: ClassVar[dict[str, tuple[Any, ...]]] = _NO_OP_VALUES
    vllm_fields_not_implemented: ClassVar[frozenset[str]] = VLLM_FIELDS_NOT_IMPLEMENTED

    def refuse_unknown_fields(self) -> None:
        extra = self.model_extra or {}
        unknown = [name for name in self.unknown_fields()
                   if not any(extra[name] == value and type(extra[name]) is type(value)
                              for value in self.no_op_values.get(name, ()))]
        if not unknown:
            return
        not_implemented = [name for name in unknown if name in self.vllm_fields_not_implemented]
        others = [name for name in unknown if name not in self.vllm_fields_not_implemented]
        parts = []
        if not_implemented:
            parts.append(f"vLLM's {', '.join(not_implemented)} {'is' if len(not_implemented) == 1 else 'are'} "
                         "not supported by vllm_lite")
        if others:
            parts.append(f"unknown field{'s' if len(others) > 1 else ''}: {', '.join(others)}")
        raise RequestParamError(unknown[0], "; ".join(parts))


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
                    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "stream_interval",
                    "allowed_token_ids", "bad_words", "thinking_token_budget", "repetition_detection",
                    "spaces_between_special_tokens")


# vLLM's vllm_xargs: a request's SamplingParams.extra_args (for the server's custom logits processors).
VllmXargs = dict[str, str | int | float | list[str | int | float]]


# What beam search reads of the sampling fields; the others are refused with it.
_BEAM_SEARCH_FIELDS = ("n", "temperature", "ignore_eos", "skip_special_tokens")


class StreamOptions(OpenAIBaseModel):
    # vLLM 0.32's defaults: `stream_options: {}` asks for no usage.
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk too


@dataclass(frozen=True, slots=True)
class StreamUsage:
    final: bool  # a last chunk with the whole request's usage
    every_chunk: bool  # continuous_usage_stats: each chunk carries the usage so far


class _GenerationRequest(NullsAsDefaults, RequestModel):
    """Fields completions and chat completions share."""

    nulls_as_defaults: ClassVar[frozenset[str]] = frozenset({"n", "stream", "return_token_ids", "logprobs", "echo"})

    model: str | None = None
    n: int = 1
    # vLLM's: lower is served first (--scheduling-policy priority; else only 0); a 64-bit int.
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    # vLLM's: the most tokens of a thinking section before `</think>` is forced (needs --reasoning-parser)
    thinking_token_budget: int | None = None
    bad_words: list[str] | None = Field(default=None, description=(
        "vLLM: words never generated (each word's last token is banned where the output ends with the rest)"))
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # a torch.long, as vLLM
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: a conversation's stable id, which labels its KV-cache events for a router (no KV
    # events here: it changes nothing, as `user`)
    session_id: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream_interval: int | None = Field(default=None, ge=1, description=(
        "vLLM: a streamed chunk every this many new tokens (the first and last at once); raises the "
        "server's --stream-interval for this request, never lowers it"))
    request_id: str | None = Field(default=None, description=(
        "vLLM: the response's id after its 'cmpl-' / 'chatcmpl-' prefix (an X-Request-Id header wins); "
        f"1 to {MAX_REQUEST_ID_CHARS} characters; unset, a random one"))
    cache_salt: str | None = Field(default=None, min_length=1, description=(
        "vLLM's prefix-cache salt: requests share cached prompt blocks only with requests of the same salt"))
    vllm_xargs: VllmXargs | None = Field(default=None, description=(
        "vLLM: arguments for the server's custom logits processors (--logits-processors), as "
        "SamplingParams.extra_args; refused when it has none"))
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
    prompt_logprobs: int | None = Field(default=None, description=(
        "vLLM: top-k logprobs per prompt token (-1 = whole vocabulary, within the server's max_logprobs)"))
    logprob_token_ids: list[int] | None = Field(default=None, description=(
        "vLLM: per output token, the logprobs of these token ids (and of the sampled token) instead of "
        "the top-k; needs logprobs; at most 128 ids"))
    return_token_ids: bool = Field(default=False, description=(
        "vLLM: choices carry the generated `token_ids` and the prompt's `prompt_token_ids`"))
    return_tokens_as_token_ids: bool | None = Field(default=None, description=(
        "vLLM: logprob tokens are written as 'token_id:<int>' instead of their text"))
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description=(
        "vLLM: keep only this many prompt tokens (-1 = max_model_len)"))
    use_beam_search: bool = Field(default=False, description=(
        "vLLM: beam search of width n (the n best beams are the choices)"))
    length_penalty: float = Field(default=1.0, description="vLLM: beam score = logprob / length ** length_penalty")
    truncation_side: Literal["left", "right"] | None = Field(default=None, description=(
        "which end truncate_prompt_tokens cuts: 'left' (the default for a generating model, as vLLM: "
        "the last tokens are kept) or 'right'"))
    spaces_between_special_tokens: bool | None = Field(default=None, description=(
        "vLLM: false: an added token right after another is its bare text (with skip_special_tokens false)"))
    repetition_detection: dict[str, Any] | None = Field(default=None, description=(
        "vLLM: {max_pattern_size, min_pattern_size, min_count}: generation stops (finish_reason "
        "'repetition') once the output ends with min_count equal runs of one pattern length"))

    def beam_search_params(self, max_tokens: int | None, logprobs: Any,
                           skip_special_tokens: bool = True) -> BeamSearchParams | None:
        """With use_beam_search, its parameters (beam width = n, as vLLM); sampling fields beam
        search does not use are refused by name rather than ignored, and so is a length_penalty
        without it (vLLM drops it unread there). `skip_special_tokens`: the sampling params' (the
        request's, or what a parser needs)."""
        if not self.use_beam_search:
            _check(self.length_penalty == 1.0, "length_penalty",
                   f"length_penalty scores beams: it needs use_beam_search, got {self.length_penalty} without it")
            return None
        unused = [name for name in _SAMPLING_FIELDS if name not in _BEAM_SEARCH_FIELDS
                  and getattr(self, name) not in (None, [])]
        _check(not self.logprob_token_ids, "logprob_token_ids",
               "`logprob_token_ids` is not supported with beam search.")
        if logprobs or self.prompt_logprobs is not None:
            unused.append("logprobs" if logprobs else "prompt_logprobs")
        _check(not unused, unused[0] if unused else "use_beam_search",
               f"{', '.join(unused)} cannot be used with use_beam_search")
        _check(max_tokens is not None, "max_tokens", "max_tokens is needed with use_beam_search")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=bool(self.ignore_eos),
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                skip_special_tokens=skip_special_tokens)

    def stream_usage(self, force_include_usage: bool) -> StreamUsage:
        """Which usage a stream carries (vLLM 0.32's should_include_usage: the server's
        --enable-force-include-usage means usage on every chunk and at the end, whatever
        stream_options say)."""
        if force_include_usage:
            return StreamUsage(final=True, every_chunk=True)
        options = self.stream_options
        if options is None:
            return StreamUsage(final=False, every_chunk=False)
        final = bool(options.include_usage)
        return StreamUsage(final=final, every_chunk=final and bool(options.continuous_usage_stats))

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int | None,
                         max_tokens_field: str = "max_tokens", prompt_logprobs: int | None = None,
                         defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """Unset fields take the model's sampling `defaults` (its generation config, vLLM's rule:
        a default max_tokens also caps a given one), else SamplingParams' defaults; the server
        reads outputs as deltas. `max_tokens_field` is the request field `max_tokens` came from
        (named in errors); -1 logprob counts become `vocab_size`."""
        _check(max_tokens is None or max_tokens >= 1, max_tokens_field,
               f"{max_tokens_field} must be >= 1, got {max_tokens}")
        defaults = defaults or {}
        given = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        kwargs = {name: value for name, value in given.items() if value is not None}
        kwargs.update((name, value) for name, value in defaults.items() if name != "max_tokens" and name not in kwargs)
        if "max_tokens" in defaults:
            max_tokens = min(defaults["max_tokens"], max_tokens or defaults["max_tokens"])
        _check(self.stream_options is None or self.stream, "stream_options",
               "stream_options is only allowed when stream is true")
        _check_logprob_count(self.prompt_logprobs, "prompt_logprobs")
        _check_logit_bias(self.logit_bias, vocab_size)
        _check(not (self.stream and self.prompt_logprobs), "prompt_logprobs",
               "prompt_logprobs are not available when stream is true")
        prompt_count = _max_count(_whole_vocab(self.prompt_logprobs, vocab_size), prompt_logprobs)
        if self.logprob_token_ids is not None:  # vLLM: the given ids replace the top-k
            _check_logprob_token_ids(self.logprob_token_ids, vocab_size)
            kwargs["logprob_token_ids"], logprobs = self.logprob_token_ids, None
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=_whole_vocab(logprobs, vocab_size),
                              prompt_logprobs=prompt_count, output_kind=RequestOutputKind.DELTA,
                              structured_outputs=self._structured_outputs(), extra_args=self.vllm_xargs or None)

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
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's: prompts as input embeddings, each a base64 torch.save'd tensor [num_tokens, hidden_size]
    # (with --enable-prompt-embeds); they come before `prompt`'s prompts in the batch
    prompt_embeds: str | list[str] | None = None
    # vLLM's: the tokenizer's special tokens (BOS) around a text prompt (token ids are taken as given)
    add_special_tokens: bool = True
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_sampling_params(self, vocab_size: int | None = None,
                           defaults: dict[str, float | int] | None = None) -> SamplingParams:
        _check((self.prompt is not None and self.prompt != "") or bool(self.prompt_embeds), "prompt",
               "Either prompt or prompt_embeds must be provided and non-empty.")
        if self.prompt_embeds:  # (vLLM's messages)
            _check(not self.echo, "echo", "Echo is unsupported with prompt embeds.")
            _check(self.prompt_logprobs is None, "prompt_logprobs",
                   "prompt_logprobs is not compatible with prompt embeds.")
            _check(not self.use_beam_search, "use_beam_search",
                   "use_beam_search with prompt_embeds is not implemented (beam search extends token ids)")
        _check_logprob_count(self.logprobs, "logprobs")
        _check(not self.logprob_token_ids or self.logprobs is not None, "logprob_token_ids",
               "when using `logprob_token_ids`, `logprobs` must be set.")
        _check(self.best_of is None or self.best_of == self.n, "best_of",
               f"best_of must equal n (other values are not supported), got {self.best_of}")
        _check(self.suffix is None, "suffix", "suffix is not supported")
        # echo with logprobs: the echoed prompt tokens get logprobs too, from prompt logprobs.
        echo_count = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, vocab_size,
                                     prompt_logprobs=_whole_vocab(echo_count, vocab_size), defaults=defaults)


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a `tool` turn: the call it answers
    # vLLM's interleaved thinking: an assistant turn's reasoning, shown to the template as
    # `reasoning` and `reasoning_content` (the name templates such as Qwen3's read);
    # `reasoning_content` is taken as the older name of the same field.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's text (its text parts joined with newlines); other parts must be images."""
        try:
            return "\n".join(content_texts(self.content))
        except ValueError as exc:
            raise RequestParamError("messages", str(exc)) from None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    # vLLM's: the image processor's keyword arguments for this request's images (over the
    # server's --mm-processor-kwargs)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: the tokenizer's special tokens on top of what the chat template writes (off: the
    # template writes them)
    add_special_tokens: bool = False
    return_prompt_text: bool | None = Field(default=None, description=(
        "vLLM: the response carries `prompt_text`, the prompt the chat template made (streamed: on the first "
        "chunk)"))
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True  # false: at most one call (vLLM: the first one parsed)
    # OpenAI's, taken as vLLM takes them: nothing the reply depends on. A completion is never
    # stored, so `store: true` (OpenAI keeps it for its dashboard) is refused by name.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None  # (routing for OpenAI's cache: the prefix cache here is automatic)
    safety_identifier: str | None = None  # (as `user`)
    # Predicted Outputs: a latency hint, the reply is the same without it (no speed-up here).
    prediction: dict[str, Any] | None = None
    # vLLM's extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = Field(default=None, description=(
        "vLLM: documents for RAG chat templates (passed to the template as `documents`)"))
    echo: bool = Field(default=False, description=(
        "vLLM: the reply starts with the last message's content when that message has the reply's role"))
    reasoning_effort: str | None = Field(default=None, description=(
        "passed to the chat template as `reasoning_effort`, with `enable_thinking` = effort != 'none' "
        "unless chat_template_kwargs sets it (as vLLM)"))
    include_reasoning: bool = Field(default=True, description=(
        "vLLM: false leaves the --reasoning-parser's reasoning (and the logprobs and token ids that "
        "would show it) out of the reply"))

    def to_sampling_params(self, vocab_size: int | None = None,
                           defaults: dict[str, float | int] | None = None) -> SamplingParams:
        _check(bool(self.messages), "messages", "messages must hold at least one message")
        self.check_unstored()
        _check(self.top_logprobs is None or self.logprobs, "top_logprobs",
               "top_logprobs needs logprobs=true")
        _check_logprob_count(self.top_logprobs, "top_logprobs")
        _check(not self.logprob_token_ids or self.logprobs, "logprob_token_ids",
               "when using `logprob_token_ids`, `logprobs` must be set to true.")
        _check(not (self.add_generation_prompt and self.continue_final_message), "continue_final_message",
               "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if self.max_completion_tokens is not None:
            max_tokens, field = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = self.max_tokens, "max_tokens"
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, vocab_size, field, defaults=defaults,
                                     prompt_logprobs=_whole_vocab(self.prompt_logprobs_count(), vocab_size))

    def prompt_logprobs_count(self) -> int | None:
        """The prompt logprobs the reply carries: `prompt_logprobs`, else with `echo` (vLLM's
        rule) `top_logprobs` of them (0: each prompt token's own); a stream carries none."""
        if self.prompt_logprobs is not None or not self.echo or self.stream:
            return self.prompt_logprobs
        return self.top_logprobs or 0

    def check_unstored(self) -> None:
        _check(not self.store, "store", "store: true is not supported: chat completions are not stored here "
               "(vLLM takes the field and stores nothing)")
        prediction = self.prediction
        _check(prediction is None or (prediction.get("type") == "content" and set(prediction) == {"type", "content"}),
               "prediction", "prediction must be {'type': 'content', 'content': ...}")

    def max_tokens_field(self) -> str:
        """The field the output budget came from (its errors name it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort (vLLM's rule)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        given = self.chat_template_kwargs or {}
        extra = {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}
        return {**extra, **given}

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them (tool calls' arguments as objects, as the
        templates of Qwen, Llama and Hermes expect)."""
        return [template_message(m) for m in self.messages]

    def reply_role(self, response_role: str) -> str:
        """The reply's role (vLLM's rule): the server's --response-role with
        add_generation_prompt, else the last message's own role (so always with
        continue_final_message)."""
        return response_role if self.add_generation_prompt or not self.messages else self.messages[-1].role

    def echoed_text(self, response_role: str) -> str:
        """With `echo`, what the reply starts with (vLLM's rule): the last message's content when
        its role is the reply's role."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        return last.text() if last.role == self.reply_role(response_role) else ""


def template_message(message: ChatMessage) -> dict[str, Any]:
    """The message for the chat template; its content keeps its parts (render_chat puts them in
    the template's content format)."""
    message.text()  # the parts are checked here, naming the field
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    reasoning = _reasoning_of(message)
    if reasoning is not None:  # (gpt-oss's template reads it as `thinking`: its analysis message)
        out["reasoning"] = out["reasoning_content"] = out["thinking"] = reasoning
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

def _reasoning_of(message: ChatMessage) -> str | None:
    reasoning, content = message.reasoning, message.reasoning_content
    if reasoning is None and content is None:
        return None
    if message.role != "assistant":
        raise RequestParamError("messages", f"only an assistant message carries reasoning, not a {message.role!r} one")
    if reasoning is not None and content is not None and reasoning != content:
        raise RequestParamError("messages", "a message's reasoning and reasoning_content differ (they are one field)")
    return reasoning if reasoning is not None else content


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's POST /v1/chat/completions/batch: the fields of a chat request, with `messages` a
    list of conversations; the response has one choice per conversation (not streamed)."""

    messages: list[list[ChatMessage]]  # type: ignore[assignment]

    def conversation_requests(self) -> list[ChatCompletionRequest]:
        _check(bool(self.messages), "messages", "messages must hold at least one conversation")
        _check(not self.stream, "stream", "the batch endpoint does not stream")
        _check(self.n == 1, "n", f"the batch endpoint answers one choice per conversation: n must be 1, got {self.n}")
        _check(not self.return_prompt_text, "return_prompt_text",
               "the batch endpoint's response has no place for each conversation's prompt text")
        return [ChatCompletionRequest.model_validate({**self.model_dump(exclude={"messages"}), "messages": []})
                .model_copy(update={"messages": conversation}) for conversation in self.messages]


class TokenizeRequest(NullsAsDefaults, RequestModel):
    """`prompt` (completions-style) or `messages` (chat-style, the chat template applied with
    the chat fields below, as in vLLM's TokenizeChatRequest)."""

    nulls_as_defaults: ClassVar[frozenset[str]] = frozenset({"return_token_strs"})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: True for a prompt; False for messages (the template adds them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False  # vLLM: also the tokens' strings (the tokenizer's own pieces)

    # The chat form's fields and their defaults: a `prompt` request that sets one otherwise is refused
    # (the field would change nothing; vLLM's completion-style tokenize request ignores it).
    CHAT_FORM_DEFAULTS: ClassVar[dict[str, Any]] = {
        "add_generation_prompt": True, "continue_final_message": False, "chat_template": None,
        "chat_template_kwargs": None, "tools": None}

    def check_form(self) -> None:
        """One of `prompt` and `messages`, and no chat field changed on a prompt."""
        _check(self.prompt is None or self.messages is None, "messages", "pass `prompt` or `messages`, not both")
        _check(self.prompt is not None or self.messages is not None, "prompt", "pass `prompt` or `messages`")
        if self.messages is None:
            for name, default in self.CHAT_FORM_DEFAULTS.items():
                _check(getattr(self, name) == default, name,
                       f"`{name}` applies to `messages` (the chat template), not to a `prompt`")

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None

    def conversation(self) -> list[dict[str, Any]]:
        _check(not (self.add_generation_prompt and self.continue_final_message), "continue_final_message",
               "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return [template_message(m) for m in self.messages or ()]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: Literal[False] = False  # (vLLM's MoE weight layout flag: no MoE LoRA here)


class CollectiveRpcRequest(RequestModel):
    """vLLM's /collective_rpc body (development mode): a worker method by name, with string
    arguments only (the method decodes them: nothing else is deserialized from a request)."""

    method: str
    args: list[str] = []
    kwargs: dict[str, str] = {}
    timeout: float | None = Field(default=None, gt=0)


class UpdateWeightVersionRequest(RequestModel):
    """vLLM's /update_weight_version body: the label of the engine's weights from now on."""

    new_version: str = Field(min_length=1)


class AbortRequestsRequest(RequestModel):
    """vLLM's /abort_requests body: the requests to abort; none named: every one in flight."""

    request_ids: list[str] | None = None


class StartProfileRequest(RequestModel):
    """vLLM's /start_profile body (optional): one session's overrides of profiler_config."""

    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id`, when given, must be the adapter's)."""

    lora_name: str
    lora_int_id: int | None = None


class RequestParamError(ValueError):
    """An invalid request field; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise RequestParamError(param, message)


def _check_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int | None) -> None:
    """Every bad key is named (as vLLM): keys that are not token ids, then ids outside the vocabulary."""
    if not logit_bias:
        return
    not_ids = [key for key in logit_bias if not key.strip().isdigit()]
    _check(not not_ids, "logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {not_ids}")
    if vocab_size is not None:
        out_of_vocab = [int(key) for key in logit_bias if int(key) >= vocab_size]
        _check(not out_of_vocab, "logit_bias", f"token_id(s) {out_of_vocab} in logit_bias contain out-of-vocab "
               f"token ids. Vocabulary size: {vocab_size}")


def _check_logprob_count(count: int | None, param: str) -> None:
    _check(count is None or count >= 0 or count == ALL_VOCAB_LOGPROBS, param,
           f"{param} must be a positive value or -1, got {count}")


def _check_logprob_token_ids(token_ids: list[int], vocab_size: int | None) -> None:
    """vLLM's checks and messages."""
    _check(bool(token_ids), "logprob_token_ids", "`logprob_token_ids` must not be an empty list.")
    _check(len(token_ids) <= MAX_LOGPROB_TOKEN_IDS, "logprob_token_ids",
           f"Requested logprob_token_ids of length {len(token_ids)}, which is greater than max allowed: "
           f"{MAX_LOGPROB_TOKEN_IDS}")
    bad = [t for t in token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    _check(not bad, "logprob_token_ids", f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab token ids. "
           f"Vocabulary size: {vocab_size}")


def _whole_vocab(count: int | None, vocab_size: int | None) -> int | None:
    """-1 (the whole vocabulary) as the vocabulary's size."""
    if count != ALL_VOCAB_LOGPROBS:
        return count
    if vocab_size is None:
        raise RequestParamError("logprobs", "-1 (the whole vocabulary) needs the model's vocabulary size")
    return vocab_size


def _max_count(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


# --------------------------------------------------------------------------- responses


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Chat with a --reasoning-parser only (as vLLM).
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=_omit_if_none)
    # vLLM's --enable-prompt-tokens-details: the prompt tokens served from the prefix cache
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
           cached_tokens: int | None = None) -> UsageInfo:
        """`reasoning_tokens` / `cached_tokens` None: no completion / prompt token details."""
        reasoning = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        cached = None if cached_tokens is None else PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, completion_tokens_details=reasoning,
                   prompt_tokens_details=cached)


class ListResponse(OpenAIBaseModel):
    """vLLM's list responses (embeddings, pooling, score): each subclass gives its `data` items."""

    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class LogprobEntry(OpenAIBaseModel):
    """One token's logprob in vLLM's `prompt_logprobs` shape ({token_id: entry} per position)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, LogprobEntry] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extras: prompt_logprobs on request; the token ids with return_token_ids (in a
    # stream, prompt_token_ids come with a choice's first chunk).
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


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


def _omit_if_empty(value: list[Any]) -> bool:
    return not value


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # --reasoning-parser; vLLM's name since it renamed `reasoning_content`.
    reasoning: str | None = Field(default=None, exclude_if=_omit_if_none)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, exclude_if=_omit_if_empty)  # as vLLM


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM puts these at the response level for chat (one prompt per request).
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None  # vLLM's return_prompt_text


class DeltaMessage(OpenAIBaseModel):
    role: str | None = Field(default=None, exclude_if=_omit_if_none)
    content: str | None = Field(default=None, exclude_if=_omit_if_none)
    reasoning: str | None = Field(default=None, exclude_if=_omit_if_none)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_omit_if_none)


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_omit_if_none)


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = Field(default=None, exclude_if=_omit_if_none)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_omit_if_none)
    prompt_text: str | None = Field(default=None, exclude_if=_omit_if_none)  # vLLM's return_prompt_text


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllm_lite"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class TokenizerInfoResponse(OpenAIBaseModel):
    """vLLM's /tokenizer_info: tokenizer_config.json's fields (extra keys) and the class."""

    tokenizer_class: str


# tokenizer_config.json entries that are paths on the server's disk (vLLM leaves them out too).
_TOKENIZER_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's init kwargs as JSON values (added tokens as their text), its class name
    and its chat template."""
    config = {key: _json_value(value) for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _TOKENIZER_FILE_FIELDS}
    config["tokenizer_class"] = type(tokenizer).__name__
    chat_template = getattr(tokenizer, "chat_template", None)
    if isinstance(chat_template, str) and chat_template:
        config["chat_template"] = chat_template
    return config


def _json_value(value: Any) -> Any:
    if hasattr(value, "content"):  # an AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
