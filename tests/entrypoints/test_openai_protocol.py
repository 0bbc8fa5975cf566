"""Request bodies -> SamplingParams: OpenAI's defaults and field names, vLLM's extras."""

from __future__ import annotations

import pytest

from vllm_lite.entrypoints.chat_content import with_content_format
from vllm_lite.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, RequestParamError,
                                                TokenizeRequest)
from vllm_lite.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm_lite.sampling_params import RequestOutputKind

CHAT = [{"role": "user", "content": "hi"}]


def test_unset_fields_keep_defaults_and_outputs_are_deltas() -> None:
    params = CompletionRequest(prompt="x").to_sampling_params()
    assert (params.max_tokens, params.temperature, params.n, params.logprobs) == (16, 1.0, 1, None)
    assert params.output_kind == RequestOutputKind.DELTA
    assert ChatCompletionRequest(messages=CHAT).to_sampling_params().max_tokens is None  # up to the context


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    request = ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=7)
    assert request.to_sampling_params().max_tokens == 7
    assert ChatCompletionRequest(messages=CHAT, max_tokens=5).to_sampling_params().max_tokens == 5


def test_chat_logprobs_flag_and_top_logprobs() -> None:
    assert ChatCompletionRequest(messages=CHAT, logprobs=True).to_sampling_params().logprobs == 0
    assert ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=4).to_sampling_params().logprobs == 4
    assert ChatCompletionRequest(messages=CHAT).to_sampling_params().logprobs is None
    with pytest.raises(RequestParamError, match="top_logprobs needs logprobs=true") as info:
        ChatCompletionRequest(messages=CHAT, top_logprobs=2).to_sampling_params()
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize("fields, param", [
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream=true
])
def test_unsupported_completion_fields_are_rejected(fields: dict, param: str) -> None:
    with pytest.raises(RequestParamError) as info:
        CompletionRequest(prompt="x", **fields).to_sampling_params()
    assert info.value.param == param


def test_string_stop_and_logit_bias_keys() -> None:
    params = CompletionRequest(prompt="x", stop="\n\n", logit_bias={"12": 200}).to_sampling_params()
    assert params.stop == ["\n\n"] and params.logit_bias == {12: 100.0}  # OpenAI's clamp


def test_text_content_parts_and_unknown_fields() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
                                    frobnicate=True)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert request.conversation() == [{"role": "user", "content": parts}]  # render_chat picks the format
    assert with_content_format(request.conversation(), "string") == [{"role": "user", "content": "a\nb"}]
    assert request.unknown_fields() == ["frobnicate"]
    # (an image part passes here; the template's content format refuses it where the model takes no images)
    image = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="only text content parts are supported, got a part of type 'image_url'"):
        with_content_format(image.conversation(), "string")
    audio = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(RequestParamError, match="only text content parts.*audio and video inputs are not implemented"):
        audio.conversation()


def test_echo_with_logprobs_asks_prompt_logprobs_and_minus_one_is_the_vocabulary() -> None:
    params = CompletionRequest(prompt="x", echo=True, logprobs=2).to_sampling_params()
    assert params.logprobs == 2 and params.prompt_logprobs == 2
    assert CompletionRequest(prompt="x", logprobs=2).to_sampling_params().prompt_logprobs is None
    params = CompletionRequest(prompt="x", logprobs=-1, prompt_logprobs=-1).to_sampling_params(vocab_size=300)
    assert params.logprobs == 300 and params.prompt_logprobs == 300
    chat = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=-1).to_sampling_params(vocab_size=300)
    assert chat.logprobs == 300


def test_an_assistant_message_s_reasoning_reaches_the_template() -> None:
    """vLLM's interleaved thinking: an assistant turn's `reasoning` is shown to the template as
    reasoning and reasoning_content (Qwen3's templates read the latter); `reasoning_content` in
    the request is the same field's older name. It was dropped unseen."""
    def conversation(**message: str) -> list[dict]:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}, {"content": "a", **message}])
        return request.conversation()

    for field in ("reasoning", "reasoning_content"):
        shown = conversation(role="assistant", **{field: "thought"})[1]
        assert shown["reasoning"] == shown["reasoning_content"] == "thought"
    assert "reasoning" not in conversation(role="assistant")[1]
    with pytest.raises(RequestParamError, match="only an assistant message carries reasoning"):
        conversation(role="user", reasoning="x")
    with pytest.raises(RequestParamError, match="differ"):
        conversation(role="assistant", reasoning="x", reasoning_content="y")


def test_openai_s_bookkeeping_fields_are_taken_and_store_true_is_refused() -> None:
    """vLLM 0.32 takes metadata, service_tier and store on chat (they change no reply); a
    completion is never stored here, so store: true is refused by name rather than dropped."""
    from vllm_lite.entrypoints.openai.server_state import ServerOptions
    from vllm_lite.entrypoints.openai.serving_tools import plan_tools

    base = {"messages": [{"role": "user", "content": "hi"}]}
    request = ChatCompletionRequest(**base, store=False, metadata={"team": "a"}, service_tier="auto")
    assert not request.unknown_fields()
    request.to_sampling_params()
    with pytest.raises(RequestParamError, match="store: true is not supported") as refused:
        ChatCompletionRequest(**base, store=True).to_sampling_params()
    assert refused.value.param == "store"
    # Fields no reply depends on (vLLM takes them): a cache-routing key, a user id, a latency hint,
    # a text reply's modalities.
    taken = ChatCompletionRequest(**base, prompt_cache_key="k", safety_identifier="s", modalities=["text"],
                                  prediction={"type": "content", "content": "Hello"})
    taken.refuse_unknown_fields()
    taken.to_sampling_params()
    with pytest.raises(RequestParamError, match="modalities"):  # (an audio reply changes the reply)
        ChatCompletionRequest(**base, modalities=["text", "audio"]).refuse_unknown_fields()
    with pytest.raises(RequestParamError, match="prediction must be"):
        ChatCompletionRequest(**base, prediction={"type": "other"}).to_sampling_params()
    with pytest.raises(RequestParamError, match="must not be an empty array") as refused:  # (vLLM's answer)
        plan_tools(ChatCompletionRequest(**base, tools=[], tool_choice="none"), ServerOptions())
    assert refused.value.param == "tools"


def test_vllms_detokenization_and_repetition_fields_reach_the_sampling_params() -> None:
    """spaces_between_special_tokens (tests/engine/test_detokenizer.py shows its effect) and
    repetition_detection (tests/test_repetition_detection.py), on both generation routes."""
    for request in (CompletionRequest(prompt="x", spaces_between_special_tokens=False,
                                      repetition_detection={"max_pattern_size": 4, "min_count": 3}),
                    ChatCompletionRequest(messages=CHAT, spaces_between_special_tokens=False,
                                          repetition_detection={"max_pattern_size": 4, "min_count": 3})):
        params = request.to_sampling_params()
        assert params.spaces_between_special_tokens is False
        assert (params.repetition_detection.max_pattern_size, params.repetition_detection.min_count) == (4, 3)
    assert CompletionRequest(prompt="x").to_sampling_params().spaces_between_special_tokens is True


def test_null_fields_vllm_takes_as_their_default_are_taken() -> None:
    """OpenAI's clients and frameworks send null for fields they do not set; where vLLM takes a
    null (n, stream, logprobs, echo, return_token_ids, Responses' stream / store, tokenize's
    return_token_strs) it is the field's default here too, not a 400. Other nulls stay refused."""
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": None,
                                                 "stream": None, "logprobs": None, "return_token_ids": None})
    assert (chat.n, chat.stream, chat.logprobs, chat.return_token_ids) == (1, False, False, False)
    completion = CompletionRequest.model_validate({"prompt": "x", "echo": None, "stream": None, "n": None})
    assert (completion.echo, completion.stream, completion.n) == (False, False, 1)
    responses = ResponsesRequest.model_validate({"input": "x", "stream": None, "store": None})
    assert (responses.stream, responses.store) == (False, True)
    assert TokenizeRequest.model_validate({"prompt": "x", "return_token_strs": None}).return_token_strs is False
    with pytest.raises(ValueError, match="priority"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "priority": None})
