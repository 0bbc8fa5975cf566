"""The streaming chunk sent once per token per stream, in its common form (no logprobs, no
per-chunk usage, no tool calls), encoded by msgspec instead of built and dumped by pydantic.

A served stream pays for its chunks on every token: building `CompletionStreamResponse` (or the
chat one) and its choice, then `model_dump_json`, took ~8 us per chunk, about a tenth of the API
server's CPU per streamed token; these structs take ~1 us. They mirror the pydantic models of
protocol.py field for field and in the same order, with the same fields left out when None, so
the bytes sent are the same: tests/entrypoints/test_stream_chunks.py compares the two encodings
over every kind of chunk these structs serve. Chunks of any other form keep the pydantic models.
"""

from __future__ import annotations

import msgspec

_ENCODER = msgspec.json.Encoder()


class CompletionChunkChoice(msgspec.Struct):
    """protocol.CompletionResponseChoice without logprobs."""

    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: None
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None


class CompletionChunk(msgspec.Struct):
    """protocol.CompletionStreamResponse without usage (pydantic leaves a None usage out)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChunkChoice]


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """protocol.DeltaMessage without tool calls (every field left out when None)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None


class ChatChunkChoice(msgspec.Struct, omit_defaults=True):
    """protocol.ChatCompletionStreamChoice without logprobs (sent as null); token_ids left out
    when None."""

    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    """protocol.ChatCompletionStreamResponse without usage; prompt_token_ids left out when None."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = None


def completion_chunk_event(request_id: str, created: int, model: str, choice: CompletionChunkChoice) -> bytes:
    return _event(CompletionChunk(request_id, "text_completion", created, model, [choice]))


def chat_chunk_event(request_id: str, created: int, model: str, choice: ChatChunkChoice,
                     prompt_token_ids: list[int] | None = None) -> bytes:
    return _event(ChatChunk(request_id, "chat.completion.chunk", created, model, [choice], prompt_token_ids))


def _event(chunk: msgspec.Struct) -> bytes:
    return b"data: %b\n\n" % _ENCODER.encode(chunk)
