"""vLLM's score and rerank APIs on an embedding model's server (a bi-encoder): `/score` (and
`/v1/score`) scores pairs of texts, `/rerank` (`/v1/rerank`, `/v2/rerank`: Jina's and Cohere's
shape) orders documents by their score against a query. On an embedding model (a bi-encoder) a
pair's score is the cosine similarity of the two texts' embeddings, as vLLM computes it; each
text given is embedded by one engine request (the query of a 1 : N request once). On a
cross-encoder (a classification model of one label) it is the model's probability for the pair
tokenized together (`tokenizer(text_1, text_pair=text_2)`, vLLM's), one engine request per pair.
The chat-template fields of vLLM's scoring requests (`instruction`, `chat_template_kwargs`) and
per-side truncation are refused by name.

| request | pairs |
|---|---|
| score: `queries` + `documents` (or vLLM's other names: `queries` + `items`, `data_1` + `data_2`, `text_1` + `text_2`) | 1 : N (the one query against each document) or N : N (pairwise) |
| rerank: `query` + `documents`, `top_n` (0: all) | 1 : N, results sorted by `relevance_score`, highest first |
"""

from __future__ import annotations

import asyncio
from typing import ClassVar, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from vllm_lite.lora.request import LoRARequest
from vllm_lite.entrypoints.openai.errors import ApiError
from vllm_lite.entrypoints.openai.protocol import (VLLM_FIELDS_NOT_IMPLEMENTED, ListResponse, OpenAIBaseModel,
                                                   RequestModel, RequestParamError, UsageInfo, request_ids)
from vllm_lite.entrypoints.openai.serving import (ServingContext, check_length, check_prompt_chars,
                                                  check_request_priority, json_response, off_loop, truncation)
from vllm_lite.entrypoints.openai.serving_completion import engine_prompts
from vllm_lite.entrypoints.openai.serving_embedding import encode_one
from vllm_lite.entrypoints.scoring import cosine_scores, pair_indices
from vllm_lite.pooling_params import PoolingParams, resolve_pooling
from vllm_lite.sampling_params import INT64_MAX, INT64_MIN

# vLLM's names for the two sides of a score request, in the order it reads them
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
ScoreInput = str | list[str]


class ScoringRequest(RequestModel):
    """The fields vLLM's score and rerank requests share."""

    vllm_fields_not_implemented: ClassVar[frozenset[str]] = VLLM_FIELDS_NOT_IMPLEMENTED | {
        "padding", "instruction", "chat_template_kwargs"}

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    max_tokens_per_query: int = Field(default=0, ge=0)
    max_tokens_per_doc: int = Field(default=0, ge=0)
    use_activation: bool | None = None  # (normalization: the cosine is the same either way)
    request_id: str | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)

    def check_supported(self) -> None:
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            if getattr(self, name):
                raise RequestParamError(name, f"{name} is not supported by vllm_lite (per-side truncation); "
                                        "truncate_prompt_tokens truncates each text")


class ScoreRequest(ScoringRequest):
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    items: ScoreInput | None = None
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None
    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None

    def sides(self) -> tuple[list[str], list[str]]:
        given = [(first, second) for first, second in SCORE_SIDES
                 if getattr(self, first) is not None and getattr(self, second) is not None]
        named = [name for pair in SCORE_SIDES for name in pair if getattr(self, name) is not None]
        if len(given) != 1 or len(set(named)) != 2:
            raise RequestParamError(named[0] if named else "queries", "a score request takes one pair of fields: "
                                    "queries and documents (or items), data_1 and data_2, or text_1 and text_2; "
                                    f"got {sorted(set(named)) or 'none'}")
        first, second = given[0]
        return _texts(getattr(self, first)), _texts(getattr(self, second))


class RerankRequest(ScoringRequest):
    query: str
    documents: ScoreInput
    top_n: int = Field(default=0, ge=0)


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreResponseData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def _texts(value: ScoreInput) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


async def create_score(ctx: ServingContext, request: ScoreRequest, raw_request: Request) -> Response:
    first, second = request.sides()
    names = next(pair for pair in SCORE_SIDES if getattr(request, pair[0]) is not None
                 and getattr(request, pair[1]) is not None)
    pairs = pair_indices(len(first), len(second), *names)
    model, lora = ctx.served_model_and_lora(request.model)
    response_id, engine_id = request_ids("score", raw_request.headers.get("x-request-id"), request.request_id)

    async def respond() -> ScoreResponse:
        scores, prompt_tokens = await _pair_scores(ctx, request, first, second, pairs, engine_id, lora)
        data = [ScoreResponseData(index=i, score=score) for i, score in enumerate(scores)]
        return ScoreResponse(id=response_id, model=model, data=data, usage=UsageInfo.of(prompt_tokens, 0))

    return await json_response(respond(), raw_request)


async def create_rerank(ctx: ServingContext, request: RerankRequest, raw_request: Request) -> Response:
    documents = _texts(request.documents)
    pairs = pair_indices(1, len(documents), "query", "documents")
    model, lora = ctx.served_model_and_lora(request.model)
    response_id, engine_id = request_ids("rerank", raw_request.headers.get("x-request-id"), request.request_id)

    async def respond() -> RerankResponse:
        scores, prompt_tokens = await _pair_scores(ctx, request, [request.query], documents, pairs, engine_id, lora)
        results = [RerankResult(index=i, document=RerankDocument(text=documents[i]), relevance_score=score)
                   for i, score in enumerate(scores)]
        results.sort(key=lambda result: result.relevance_score, reverse=True)
        top_n = request.top_n or len(results)
        return RerankResponse(id=response_id, model=model, results=results[:top_n],
                              usage=RerankUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens))

    return await json_response(respond(), raw_request)


async def _pair_scores(ctx: ServingContext, request: ScoringRequest, first: list[str], second: list[str],
                       pairs: list[tuple[int, int]], engine_id: str,
                       lora: LoRARequest | None) -> tuple[list[float], int]:
    """Each pair's score (an embedding model's cosine, a cross-encoder's probability) and the
    prompt tokens they took."""
    pooler = ctx.engine.vllm_config.model_config.pooler
    if pooler is None:
        raise ApiError(400, "BadRequestError", "The model does not support Score API: it generates text (an "
                       "embedding model or a cross-encoder runs with --runner pooling)", "model")
    request.check_supported()
    check_request_priority(ctx, request.priority)
    if pooler.task == "classify":
        return await _cross_encoder_scores(ctx, request, first, second, pairs, engine_id, lora)
    (left, right), prompt_tokens = await _embed_sides(ctx, request, first, second, engine_id, lora)
    return cosine_scores(left, right, pairs), prompt_tokens


async def _cross_encoder_scores(ctx: ServingContext, request: ScoringRequest, first: list[str], second: list[str],
                                pairs: list[tuple[int, int]], engine_id: str,
                                lora: LoRARequest | None) -> tuple[list[float], int]:
    model_config = ctx.engine.vllm_config.model_config
    if len(model_config.pooler.labels) != 1:
        raise ApiError(400, "BadRequestError", "Score API is only enabled for num_labels == 1 (this classifier has "
                       f"{len(model_config.pooler.labels)} labels)", "model")
    params = resolve_pooling(PoolingParams(request.use_activation), model_config)
    truncate = truncation(ctx, request.truncate_prompt_tokens, request.truncation_side, pooling=True)
    tokenizer = ctx.require_tokenizer("text_1")

    def pair_ids(i: int, j: int) -> list[int]:
        ids = tokenizer(first[i], text_pair=second[j])["input_ids"]
        return truncate.apply(ids) if truncate is not None else ids

    if truncate is None:
        for i, j in pairs:
            check_prompt_chars(ctx, len(first[i]) + len(second[j]), "documents")
    prompts = [{"prompt_token_ids": await off_loop(ctx, pair_ids, i, j)} for i, j in pairs]
    for prompt in prompts:
        check_length(ctx, len(prompt["prompt_token_ids"]), "documents")
    outputs = await asyncio.gather(*(encode_one(ctx, prompt, params, f"{engine_id}-{k}", request.priority, lora)
                                     for k, prompt in enumerate(prompts)))
    return [output.outputs.probs[0] for output in outputs], sum(len(o.prompt_token_ids) for o in outputs)


async def _embed_sides(ctx: ServingContext, request: ScoringRequest, first: list[str], second: list[str],
                       engine_id: str, lora: LoRARequest | None = None) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """Both sides' embeddings (float32 `[texts, dim]` each) and the prompt tokens they took."""
    model_config = ctx.engine.vllm_config.model_config
    params = resolve_pooling(PoolingParams(request.use_activation), model_config)
    truncate = truncation(ctx, request.truncate_prompt_tokens, request.truncation_side, pooling=True)
    prompts = await engine_prompts(ctx, first + second, None, truncate, param="documents")
    outputs = await asyncio.gather(*(encode_one(ctx, prompt, params, f"{engine_id}-{i}", request.priority, lora)
                                     for i, prompt in enumerate(prompts)))
    vectors = np.asarray([output.outputs.embedding for output in outputs], dtype=np.float32)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return (vectors[:len(first)], vectors[len(first):]), prompt_tokens
