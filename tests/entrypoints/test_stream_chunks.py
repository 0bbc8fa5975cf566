"""The per-token streaming chunks that msgspec encodes (entrypoints/openai/stream_chunks.py) are
byte-for-byte the JSON of the pydantic models they stand in for, over texts with every ASCII
control character, quotes, backslashes and non-ASCII characters, and every optional field set and
unset."""

from __future__ import annotations

import itertools

import pytest

from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, CompletionResponseChoice, CompletionStreamResponse,
    DeltaMessage,
)
from vllm_lite.entrypoints.openai.serving import sse_event
from vllm_lite.entrypoints.openai.stream_chunks import (
    ChatChunkChoice, ChatDelta, CompletionChunkChoice, chat_chunk_event, completion_chunk_event,
)

TEXTS = ["", " the", "".join(map(chr, range(0, 128))), 'quote " and \\ slash /', "é 中文 🙂 \u2028\u2029 \ufeff"]
REASONS = [(None, None), ("stop", None), ("stop", 7), ("stop", "</s>"), ("length", None)]
IDS = [None, [], [1, 2, 50000]]


@pytest.mark.parametrize("text", TEXTS)
def test_completion_chunk_is_the_pydantic_json(text: str) -> None:
    for (finish, stop), prompt_ids, token_ids in itertools.product(REASONS, IDS, IDS):
        expected = sse_event(CompletionStreamResponse(
            id="cmpl-1", created=1700000000, model="m/x", choices=[CompletionResponseChoice(
                index=3, text=text, finish_reason=finish, stop_reason=stop, prompt_token_ids=prompt_ids,
                token_ids=token_ids)]))
        got = completion_chunk_event("cmpl-1", 1700000000, "m/x", CompletionChunkChoice(
            3, text, None, finish, stop, None, prompt_ids, token_ids))
        assert got == expected


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunk_is_the_pydantic_json(text: str) -> None:
    for content, reasoning in ((text, None), (None, text), (text, "why"), (None, None)):
        for (finish, stop), token_ids, prompt_ids in itertools.product(REASONS, IDS, IDS):
            expected = sse_event(ChatCompletionStreamResponse(
                id="chatcmpl-1", created=1700000000, model="m", prompt_token_ids=prompt_ids,
                choices=[ChatCompletionStreamChoice(index=1, delta=DeltaMessage(content=content, reasoning=reasoning),
                                                    finish_reason=finish, stop_reason=stop, token_ids=token_ids)]))
            got = chat_chunk_event("chatcmpl-1", 1700000000, "m", ChatChunkChoice(
                1, ChatDelta(content=content, reasoning=reasoning), None, finish, stop, token_ids), prompt_ids)
            assert got == expected
