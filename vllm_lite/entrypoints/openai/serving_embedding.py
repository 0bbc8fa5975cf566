"""POST /v1/embeddings (vLLM's embedding API, on a server of an embedding model: runner='pooling'),
and vLLM's /pooling with the `embed` task (the same vectors in its pooling response shape).

`input` is a text, texts, token ids or lists of token ids; each becomes one engine request whose
prompt's vector is the embedding (`AsyncLLM.encode`). `encoding_format` "float" gives lists of
numbers; "base64" the vector's raw bytes (`embed_dtype` float32, float16 or bfloat16; `endianness`),
as the OpenAI client decodes them; `dimensions` for a Matryoshka model.

vLLM's chat form: `messages` (one conversation, or a list of them) or an `input` holding them;
each conversation goes through the chat template (`add_generation_prompt` false by default,
`continue_final_message`, `chat_template`, `chat_template_kwargs`; the tokenizer's special tokens
only with `add_special_tokens`, false for this form) and is one embedding. vLLM's binary
formats (bytes, bytes_only) and fp8 dtypes are refused by name."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import Any, ClassVar, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from vllm_lite.lora.request import LoRARequest
from vllm_lite.config import ModelConfig
from vllm_lite.entrypoints.openai.errors import ApiError
from vllm_lite.entrypoints.openai.metrics import RequestTracker
from vllm_lite.entrypoints.openai.protocol import (VLLM_FIELDS_NOT_IMPLEMENTED, ChatMessage, ListResponse,
                                                   OpenAIBaseModel, RequestModel, RequestParamError, UsageInfo,
                                                   request_ids, template_message)
from vllm_lite.entrypoints.openai.serving import (ServingContext, Truncation, check_prompt_chars,
                                                  check_request_priority, encode_prompt, json_response, render_chat,
                                                  truncation)
from vllm_lite.entrypoints.openai.serving_completion import engine_prompts
from vllm_lite.exceptions import RequestAbortedError
from vllm_lite.outputs import ClassificationRequestOutput, EmbeddingRequestOutput
from vllm_lite.pooling_params import PoolingParams, resolve_pooling
from vllm_lite.sampling_params import INT64_MAX, INT64_MIN

EMBED_DTYPES = {"float32": np.float32, "float16": np.float16}  # bfloat16: rounded by hand (no torch here)


class PoolingInputRequest(RequestModel):
    """What vLLM's pooling requests share (its PoolingBasic, Completion and Chat mixins): the
    input as texts or token ids, or as conversations through the chat template."""

    vllm_fields_not_implemented: ClassVar[frozenset[str]] = VLLM_FIELDS_NOT_IMPLEMENTED | {"padding"}

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | list[ChatMessage] | list[list[ChatMessage]] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    # vLLM's chat form's options (its defaults for pooling)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    use_activation: bool | None = Field(default=None, description=(
        "vLLM: embeddings: L2-normalize; classification: the model's activation (softmax, sigmoid) over the "
        "logits (None: the server's pooler config, on by default)"))
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None  # None: vLLM's default, true for texts, false for conversations
    request_id: str | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1)

    def conversations(self) -> list[list[ChatMessage]] | None:
        """The chat form's conversations (None: the plain form). `messages` wins as vLLM reads it;
        a conversation in `input` with it is refused rather than dropped."""
        given = self.messages
        if given is None and _holds_messages(self.input):
            given = self.input
        elif given is not None and self.input is not None:
            raise RequestParamError("input", "give either input or messages, not both")
        if given is None:
            if self.input is None:
                raise RequestParamError("input", "input (texts or token ids) or messages (a conversation) is "
                                        "required")
            _check_plain_options(self)
            return None
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestParamError("continue_final_message", "Cannot set both `continue_final_message` and "
                                    "`add_generation_prompt` to True.")
        conversations = given if isinstance(given[0], list) else [given]
        if not all(conversations):
            raise RequestParamError("messages", "each conversation must hold at least one message")
        return conversations

    def pooling_params(self, model_config: ModelConfig) -> PoolingParams:
        """The request's pooling, checked against the model."""
        return resolve_pooling(PoolingParams(self.use_activation), model_config)


class EmbeddingRequest(PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    dimensions: int | None = None

    def pooling_params(self, model_config: ModelConfig) -> PoolingParams:
        """The request's pooling, checked against the model (a 400 naming `dimensions`)."""
        try:
            return resolve_pooling(PoolingParams(self.use_activation, self.dimensions), model_config)
        except ValueError as exc:
            raise RequestParamError("dimensions", str(exc).removeprefix("PoolingParams.dimensions: ")) from None


class ClassificationRequest(PoolingInputRequest):
    """vLLM's /classify body (its completion and chat forms)."""


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(ListResponse):
    data: list[ClassificationData]


def _holds_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], (ChatMessage, list)) and (
        not isinstance(value[0], list) or (bool(value[0]) and isinstance(value[0][0], ChatMessage)))


def _check_plain_options(request: PoolingInputRequest) -> None:
    """The chat form's options with texts or token ids: refused (they would change nothing)."""
    for name in ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"):
        if name in request.model_fields_set and getattr(request, name) not in (None, False):
            raise RequestParamError(name, f"{name} applies to messages (a conversation), not to input texts or "
                                    "token ids")


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling (its completion-style form): the model's task (`embed`: the vectors of
    /v1/embeddings; `classify`: the probabilities of /classify) in vLLM's pooling response shape.
    `task` unset: the model's; another than the model's is refused."""

    task: Literal["embed", "classify"] | None = None


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingResponseData]


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(ListResponse):
    data: list[PoolingResponseData]


async def create_embedding(ctx: ServingContext, request: EmbeddingRequest, raw_request: Request) -> Response:
    """/v1/embeddings, and /pooling (a PoolingRequest) in its own response shape."""
    pooling = isinstance(request, PoolingRequest)
    model, lora = ctx.served_model_and_lora(request.model)
    pooler = ctx.engine.vllm_config.model_config.pooler
    task = (request.task or (pooler.task if pooler is not None else "embed")) if pooling else "embed"
    _check_task(ctx, task, "Pooling" if pooling else "Embeddings", "task" if pooling and request.task else "model")
    params = request.pooling_params(ctx.engine.vllm_config.model_config)
    prompts = await _pooling_prompts(ctx, request)
    response_id, engine_id = request_ids("pool" if pooling else "embd", raw_request.headers.get("x-request-id"),
                                         request.request_id)
    work = [encode_one(ctx, prompt, params, f"{engine_id}-{i}", request.priority, lora)
            for i, prompt in enumerate(prompts)]
    return await json_response(_response(request, model, response_id, work), raw_request)


async def create_classification(ctx: ServingContext, request: ClassificationRequest, raw_request: Request) -> Response:
    """vLLM's /classify: each input's class probabilities, its most likely label named."""
    model, lora = ctx.served_model_and_lora(request.model)
    _check_task(ctx, "classify", "Classification")
    params = request.pooling_params(ctx.engine.vllm_config.model_config)
    prompts = await _pooling_prompts(ctx, request)
    response_id, engine_id = request_ids("classify", raw_request.headers.get("x-request-id"), request.request_id)
    labels = ctx.engine.vllm_config.model_config.pooler.labels
    work = [encode_one(ctx, prompt, params, f"{engine_id}-{i}", request.priority, lora)
            for i, prompt in enumerate(prompts)]

    async def respond() -> ClassificationResponse:
        outputs = await asyncio.gather(*work)
        data = [ClassificationData(index=i, label=labels[int(np.argmax(out.outputs.probs))], probs=out.outputs.probs,
                                   num_classes=len(out.outputs.probs)) for i, out in enumerate(outputs)]
        usage = UsageInfo.of(sum(len(out.prompt_token_ids) for out in outputs), 0)
        return ClassificationResponse(id=response_id, model=model, data=data, usage=usage)

    return await json_response(respond(), raw_request)


def _check_task(ctx: ServingContext, task: str, api: str, param: str = "model") -> None:
    """A 400 naming `param` when the server's model does not serve `api` with `task` (vLLM's wording)."""
    pooler = ctx.engine.vllm_config.model_config.pooler
    if pooler is None:
        raise ApiError(400, "BadRequestError", f"The model does not support {api} API: it generates text "
                       "(a pooling model runs with --runner pooling)", "model")
    if pooler.task != task:
        raise ApiError(400, "BadRequestError", f"The model does not support {api} API with task {task!r}: its "
                       f"task is {pooler.task!r}", param)


async def _pooling_prompts(ctx: ServingContext, request: PoolingInputRequest) -> list[dict[str, Any]]:
    """The request's engine prompts: its texts or token ids, or its conversations rendered."""
    check_request_priority(ctx, request.priority)
    truncate = truncation(ctx, request.truncate_prompt_tokens, request.truncation_side, pooling=True)
    conversations = request.conversations()
    if conversations is None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return await engine_prompts(ctx, request.input, request.cache_salt, truncate, param="input",
                                    add_special_tokens=special)
    return [await _conversation_prompt(ctx, request, conversation, truncate) for conversation in conversations]


async def _conversation_prompt(ctx: ServingContext, request: PoolingInputRequest, conversation: list[ChatMessage],
                               truncate: Truncation | None) -> dict[str, Any]:
    """A conversation through the chat template, then tokenized (vLLM's chat-style embeddings)."""
    if truncate is None:
        check_prompt_chars(ctx, sum(len(message.text()) for message in conversation), "messages")
    text = await render_chat(ctx, [template_message(message) for message in conversation],
                             add_generation_prompt=request.add_generation_prompt,
                             continue_final_message=request.continue_final_message,
                             chat_template=request.chat_template, chat_template_kwargs=request.chat_template_kwargs)
    prompt = await encode_prompt(ctx, text, add_special_tokens=bool(request.add_special_tokens), param="messages",
                                 truncate=truncate)
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


async def _response(request: EmbeddingRequest, model: str, response_id: str,
                    work: list[Any]) -> EmbeddingResponse | PoolingResponse:
    outputs = await asyncio.gather(*work)
    vectors = [_encoded(out.outputs.probs if isinstance(out, ClassificationRequestOutput) else out.outputs.embedding,
                        request) for out in outputs]
    usage = UsageInfo.of(sum(len(out.prompt_token_ids) for out in outputs), 0)
    if isinstance(request, PoolingRequest):
        return PoolingResponse(id=response_id, model=model, usage=usage,
                               data=[PoolingResponseData(index=i, data=v) for i, v in enumerate(vectors)])
    return EmbeddingResponse(id=response_id, model=model, usage=usage,
                             data=[EmbeddingResponseData(index=i, embedding=v) for i, v in enumerate(vectors)])


async def encode_one(ctx: ServingContext, prompt: dict[str, Any], params: PoolingParams, request_id: str,
                     priority: int, lora: LoRARequest | None = None) -> EmbeddingRequestOutput:
    """The prompt's embedding (with the LoRA adapter the request's model names); leaving early (a
    client gone) aborts it in the engine core."""
    tracker = RequestTracker(ctx.metrics, len(prompt["prompt_token_ids"]))
    ctx.drain.in_flight.add(request_id)
    finished = False
    try:
        async with contextlib.aclosing(ctx.engine.encode(prompt, params, request_id, priority,
                                                         lora_request=lora)) as outputs:
            async for output in outputs:
                finished = True
                tracker.finish_pooled(output)
                return output
    except RequestAbortedError:  # the server aborted it: shutting down past --shutdown-timeout
        pass
    finally:
        ctx.drain.in_flight.discard(request_id)
        if not finished:
            ctx.metrics.requests_aborted.inc()
    raise ApiError(503, "ServiceUnavailableError", "the request was aborted before its embedding (the server "
                   "is shutting down)")


def _encoded(embedding: list[float], request: EmbeddingRequest) -> list[float] | str:
    """`float`: the numbers; `base64`: the raw bytes in `embed_dtype` and `endianness` (the
    OpenAI client reads float32 in the machine's order, the defaults)."""
    if request.encoding_format == "float":
        return embedding
    vector = np.asarray(embedding, dtype=np.float32)
    if request.embed_dtype == "bfloat16":  # float32's upper half, rounded to nearest even (as torch casts)
        bits = vector.view(np.uint32).astype(np.uint64)
        vector = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        vector = vector.astype(EMBED_DTYPES[request.embed_dtype])
    if request.endianness != "native":
        vector = vector.astype(vector.dtype.newbyteorder("<" if request.endianness == "little" else ">"))
    return base64.b64encode(vector.tobytes()).decode("ascii")
