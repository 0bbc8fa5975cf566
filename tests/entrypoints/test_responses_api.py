"""The Responses API (/v1/responses) through the official `openai` client: against a live server
on a random-weight tiny Qwen3 (text, instructions, max_output_tokens, text.format json_schema,
function tools enforced by the grammar backend, previous_response_id, store, streaming event
order, refusals by name), and in-process over a scripted engine for the parsers' side
(reasoning items, hermes tool calls streamed in pieces)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_engine import ScriptedEngine
from hf_reference import IM_END_ID
from live_server import LONG_GENERATION, LiveServer, running_long_server, running_server
from transformers import AutoTokenizer

from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ResponseStore, ServerOptions

MODEL = "tiny-qwen3"
API_KEY = "sk-responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done", "response.completed"]


def _weather_ok(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) == {"city", "days"} and isinstance(value["city"], str) and 1 <= value["days"] <= 7


def _collapse(types: list[str]) -> list[str]:
    """Event types with repeats of one delta type shown once."""
    return [t for i, t in enumerate(types) if not (i and t == types[i - 1] and t.endswith(".delta"))]


# ---- live server ----

@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "512", "--max-stored-responses", "2")) as live:
        yield live


@pytest.fixture(scope="module")
def long_server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The server with room for a `LONG_GENERATION` reply (the cancel test's)."""
    with running_long_server(tiny_qwen3, tmp_path_factory.mktemp("long_server") / "server.log", MODEL,
                             API_KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_text_response_matches_chat_completion(client: openai.OpenAI) -> None:
    """The same conversation through both APIs gives the same greedy text and token counts."""
    response = client.responses.create(model=MODEL, input="Tell me a story", instructions="Be brief.",
                                       max_output_tokens=12, temperature=0.0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief." and response.max_output_tokens == 12


def test_streamed_events_rebuild_the_response(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=12,
                                          temperature=0.0, stream=True))
    assert _collapse([e.type for e in events]) == TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas == next(e.text for e in events if e.type == "response.output_text.done")
    whole = client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0.0)
    assert whole.output_text == deltas
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    """text.format json_schema constrains the output as chat's response_format does (the same
    greedy text); a finished output follows the schema, one cut by max_output_tokens is the start
    of an object (a random-weight model may not close it)."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
              "required": ["answer", "score"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Rate this", max_output_tokens=60, temperature=0.0,
        text={"format": {"type": "json_schema", "name": "rating", "schema": schema, "strict": True}})
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Rate this"}], max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema, "strict": True}})
    assert response.output_text == chat.choices[0].message.content
    if response.status == "completed":
        value = json.loads(response.output_text)
        assert value["answer"] in ("yes", "no") and isinstance(value["score"], int)
    else:
        assert response.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call(client: openai.OpenAI, stream: bool) -> None:
    kwargs = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=120,
                  temperature=1.0, tool_choice={"type": "function", "name": "get_weather"})
    if not stream:
        response = client.responses.create(**kwargs)
        (call,) = response.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        assert _weather_ok(call.arguments)
        return
    events = list(client.responses.create(**kwargs, stream=True))
    types = _collapse([e.type for e in events])
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1, "the arguments are streamed as they are generated"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments and _weather_ok(done.arguments)
    (call,) = events[-1].response.output
    assert call.arguments == done.arguments and call.id == done.item_id


def test_required_tool_call_then_its_result(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=150,
                                    temperature=0.0, tool_choice="required")
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and _weather_ok(c.arguments) for c in calls)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=4, temperature=0.0, tools=[WEATHER],
        tool_choice="none", input=[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                                   for c in calls])
    assert second.previous_response_id == first.id
    # The same conversation as a chat completion: the calls and their results reach the template.
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0.0, tools=chat_tools,
                                          tool_choice="none", messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]},
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls]])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0.0)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0.0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0.0, messages=[
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_store_false_and_the_bounded_store(client: openai.OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match=unstored.id):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    oldest = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for _ in range(2):  # the server keeps 2 (--max-stored-responses)
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(oldest.id)


@pytest.mark.parametrize(("extra", "param"), [
    ({"background": True, "store": False}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # (no logprobs asked for: they would be dropped unread)
    ({"reasoning": {"effort": "low", "budget": 3}}, "reasoning.budget"),
    ({"truncation": "auto"}, "truncation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_object"}, "verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"structured_outputs": {"choice": ["a"]}, "text": {"format": {"type": "json_object"}}}, "structured_outputs"),
])
def test_unsupported_fields_are_refused_by_name(server: LiveServer, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_invalid_schema_is_400_naming_the_problem_and_the_field(server: LiveServer) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}
    response = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "nope" in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == "text.format.schema"  # as OpenAI names it


def test_background_without_store_gets_vllms_message(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true"):
        client.responses.create(model=MODEL, input="hi", background=True, store=False, max_output_tokens=2)


def test_cancel_answers_as_vllm_for_a_synchronous_response(client: openai.OpenAI) -> None:
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(done.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.cancel("resp_unknown")


def _when_ended(client: openai.OpenAI, response_id: str, timeout_s: float = 60.0) -> Any:
    """The stored response once it is no longer "queued" (vLLM's status while it runs)."""
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status == "queued":
        assert time.monotonic() < deadline, f"{response_id} still queued after {timeout_s} s"
        time.sleep(0.05)
    return response


def _ending_tokens_banned(model: Path) -> dict[str, float]:
    """A logit_bias that bans every token ending a reply (the tokenizer's EOS, generation_config's
    eos_token_id): the Responses API has no ignore_eos, and a greedy reply of a random model may
    reach an EOS early on one CPU's rounding and not on another's."""
    from transformers import AutoTokenizer

    generation = json.loads((model / "generation_config.json").read_text()).get("eos_token_id", [])
    ending = {AutoTokenizer.from_pretrained(model).eos_token_id, *(generation if isinstance(generation, list)
                                                                   else [generation])}
    return {str(token): -100.0 for token in ending if token is not None}


def test_background_response_is_queued_then_stored_whole(client: openai.OpenAI, tiny_qwen3: Path) -> None:
    """vLLM's background mode: answered at once ("queued"), generated on its own, then stored as
    the same request run in the foreground would answer; a finished one cannot be cancelled."""
    fields = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 12, "temperature": 0.0,
              "extra_body": {"logit_bias": _ending_tokens_banned(tiny_qwen3)}}  # (ends at its budget: incomplete)
    queued = client.responses.create(background=True, **fields)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    ended = _when_ended(client, queued.id)
    foreground = client.responses.create(store=False, **fields)
    assert ended.status == "incomplete" and ended.background is True
    assert ended.output_text == foreground.output_text and ended.usage.output_tokens == 12
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(queued.id)


def test_a_cancelled_background_response_stops_generating(long_server: LiveServer, tiny_qwen3: Path) -> None:
    """Cancel stops the generation (the engine has nothing running after it) and the response
    stays "cancelled"; one still running cannot be continued (previous_response_id)."""
    server = long_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    queued = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=LONG_GENERATION,
                                      temperature=0.0, background=True,
                                      extra_body={"logit_bias": _ending_tokens_banned(tiny_qwen3)})
    with pytest.raises(openai.BadRequestError, match="still running"):
        client.responses.create(model=MODEL, input="and then?", previous_response_id=queued.id, max_output_tokens=2)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.3)
    assert client.responses.retrieve(queued.id).status == "cancelled"
    metrics = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    assert "vllm:num_requests_running" in metrics
    running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")]
    assert all(line.rsplit(" ", 1)[1] in ("0.0", "0") for line in running), running


def test_a_streamed_background_response_can_be_read_again(server: LiveServer, client: openai.OpenAI) -> None:
    """background + stream: the events as a foreground stream's; GET ?stream=true&starting_after=N
    gives them again from event N + 1; the stored body is the last event's response."""
    events = list(client.responses.create(model=MODEL, input="Tell me a story", max_output_tokens=12,
                                          temperature=0.0, stream=True, background=True))
    assert _collapse([e.type for e in events]) == TEXT_EVENTS
    response_id = events[-1].response.id
    again = httpx.get(f"{server.base_url}/v1/responses/{response_id}", params={"stream": "true", "starting_after": 2},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    replayed = [json.loads(line.removeprefix("data: ")) for line in again.text.splitlines() if line.startswith("data: ")]
    assert replayed == [event.model_dump(mode="json", exclude_unset=True) for event in events[3:]]
    assert client.responses.retrieve(response_id).output_text == events[-1].response.output_text
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    not_streamed = httpx.get(f"{server.base_url}/v1/responses/{plain.id}", params={"stream": "true"},
                             headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert not_streamed.status_code == 400 and not_streamed.json()["error"]["param"] == "stream", not_streamed.text


def test_response_messages_are_the_prompt_and_the_output_as_tokens(client: openai.OpenAI) -> None:
    """vLLM's enable_response_messages: input_messages / output_messages hold the prompt and the
    output as the model saw and wrote them (text and token ids), streamed or not; they are the
    chat completion's own prompt and output for the same conversation."""
    fields = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 6, "temperature": 0.0}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}],
                                          max_tokens=6, temperature=0.0, extra_body={"return_token_ids": True})
    whole = client.responses.create(**fields, extra_body={"enable_response_messages": True}).model_dump()
    streamed = list(client.responses.create(**fields, stream=True, extra_body={"enable_response_messages": True}))
    for body in (whole, streamed[-1].response.model_dump()):
        (prompt,), (output,) = body["input_messages"], body["output_messages"]
        assert prompt["type"] == output["type"] == "raw_message_tokens"
        assert prompt["tokens"] == chat.prompt_token_ids and "Tell me a story" in prompt["message"]
        assert output["tokens"] == chat.choices[0].token_ids and output["message"] == chat.choices[0].message.content
    assert "input_messages" not in client.responses.create(**fields).model_dump(exclude_unset=True)


def test_vllm_sampling_extras_run_as_on_chat(client: openai.OpenAI) -> None:
    """vLLM's sampling extras on /v1/responses are the chat fields: the same seeded sample."""
    extras = {"seed": 7, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5}
    response = client.responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=8,
                                       temperature=1.0, extra_body=extras)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about the river."}],
                                          max_tokens=8, temperature=1.0, extra_body=extras)
    assert response.output_text == chat.choices[0].message.content
    unseeded = {key: value for key, value in extras.items() if key != "seed"}
    others = {client.responses.create(model=MODEL, input="Tell me about the river.", max_output_tokens=8,
                                      temperature=1.0, extra_body={**unseeded, "seed": seed}).output_text
              for seed in (1, 2, 3)}
    assert len(others | {response.output_text}) > 1  # the seed is honoured, not dropped


def test_vllm_generation_extras_run_as_on_chat(client: openai.OpenAI) -> None:
    """vLLM's ResponsesRequest also takes `ignore_eos`, `structured_outputs` and `session_id`:
    the chat fields of the same names (they were 400s here)."""
    extras = {"ignore_eos": True, "structured_outputs": {"choice": ["yes", "no"]}, "session_id": "s-1"}
    response = client.responses.create(model=MODEL, input="Is the river long?", max_output_tokens=8,
                                       temperature=0.0, extra_body=extras)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the river long?"}],
                                          max_tokens=8, temperature=0.0, extra_body=extras)
    assert response.output_text == chat.choices[0].message.content and response.output_text in ("yes", "no")
    eos_first = {"logit_bias": {str(IM_END_ID): 100}}  # (the model's end token, <|im_end|>, first)
    counts = [client.responses.create(model=MODEL, input="Is the river long?", max_output_tokens=8, temperature=0.0,
                                      extra_body={**eos_first, **ignore}).usage.output_tokens
              for ignore in ({}, {"ignore_eos": True})]
    assert counts == [1, 8]


def test_output_text_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    """include message.output_text.logprobs: one entry per generated token with top_logprobs
    of the asked size, the same whole and streamed (greedy), each delta carrying its own."""
    body = {"model": MODEL, "input": "Tell me about the river.", "max_output_tokens": 6, "temperature": 0.0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 3}
    whole = client.responses.create(**body)
    logprobs = whole.output[-1].content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens
    assert all(len(lp.top_logprobs) == 3 and lp.logprob <= 0 for lp in logprobs)
    assert all(lp.top_logprobs[0].logprob >= lp.logprob for lp in logprobs)  # the best is first
    events = list(client.responses.create(**body, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.logprobs for e in deltas)
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in logprobs]
    assert events[-1].response.output[-1].content[0].logprobs == logprobs
    plain = client.responses.create(**{k: v for k, v in body.items() if k not in ("include", "top_logprobs")})
    assert plain.output[-1].content[0].logprobs == [] and plain.output_text == whole.output_text


def test_auto_tool_choice_needs_the_parser_flags(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.responses.create(model=MODEL, input="hi", tools=[WEATHER], max_output_tokens=2)


# ---- in-process, over a scripted engine: the parsers' side ----

def _scripted_events(tokenizer_dir: Path, script: list[str], fail_after: int | None = None,
                     **body: Any) -> list[Any]:
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tokenizer_dir), script, fail_after)
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    options = ServerOptions(api_key=API_KEY, reasoning_parser="qwen3", enable_auto_tool_choice=True,
                            tool_call_parser="hermes")

    async def go() -> list[Any]:
        app = build_app(engine, [MODEL], options=options)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=http) as client:
            stream = await client.responses.create(model=MODEL, input="hi", stream=True, **body)
            events = [event async for event in stream]
            whole = await client.responses.create(model=MODEL, input="hi", **body)
            return [*events, whole]
    return asyncio.run(go())


@pytest.mark.parametrize("script, texts", [(["\n", "\n "], ["\n\n "]), (["<think>hm</think>", " \n"], [" \n"]),
                                           (["\n\n", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'], [])])
def test_a_whitespace_reply_is_a_message_unless_beside_a_tool_call(tiny_tokenizer_dir: Path, script: list[str],
                                                                   texts: list[str]) -> None:
    """vLLM keeps a reply that is only whitespace as its message (no text is lost), whole and
    streamed alike; whitespace beside a tool call is no message."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    *events, whole = _scripted_events(tiny_tokenizer_dir, script, tools=[tool])
    streamed = events[-1].response
    for response in (whole, streamed):
        assert [item.content[0].text for item in response.output if item.type == "message"] == texts
        assert [item.type for item in response.output].count("function_call") == (0 if texts else 1)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "".join(texts)


def test_reasoning_and_text_items(tiny_tokenizer_dir: Path) -> None:
    script = ["<th", "ink>Let me ", "think.</th", "ink>\n\nThe ans", "wer."]
    *events, whole = _scripted_events(tiny_tokenizer_dir, script)
    assert _collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done", *TEXT_EVENTS[2:]]
    reasoning, message = events[-1].response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert message.type == "message" and message.content[0].text == "The answer."
    assert [(item.type, getattr(item, "content")) for item in whole.output] == \
        [(item.type, item.content) for item in events[-1].response.output]


def test_hermes_calls_streamed_in_pieces(tiny_tokenizer_dir: Path) -> None:
    text = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}</tool_call>')
    script = [text[i:i + 4] for i in range(0, len(text), 4)]
    *events, whole = _scripted_events(tiny_tokenizer_dir, script, tools=[WEATHER])
    final = events[-1].response.output
    assert [item.type for item in final] == ["message", "function_call", "function_call"]
    assert final[0].content[0].text == "Sure."
    for item in final[1:]:
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.item_id == item.id]
        assert len(deltas) > 3 and "".join(deltas) == item.arguments and _weather_ok(item.arguments)
    assert [json.loads(i.arguments) for i in whole.output[1:]] == [json.loads(i.arguments) for i in final[1:]]


def test_an_error_after_the_stream_began_is_an_error_event(tiny_tokenizer_dir: Path) -> None:
    with pytest.raises(openai.APIError, match="engine is dead"):
        _scripted_events(tiny_tokenizer_dir, ["Hello", " there", " friend"], fail_after=2)


def test_a_background_response_that_fails_is_stored_failed(tiny_tokenizer_dir: Path) -> None:
    """An error while a background response runs is its own: stored "failed" with the error,
    and a streamed one's last event is the error event; the server goes on."""
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_tokenizer_dir), ["Hello", " there", " friend"],
                            fail_after=2)
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    async def go() -> tuple[Any, list[dict[str, Any]]]:
        app = build_app(engine, [MODEL], options=ServerOptions(api_key=API_KEY))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=http) as client:
            queued = await client.responses.create(model=MODEL, input="hi", background=True)
            while (failed := await client.responses.retrieve(queued.id)).status == "queued":
                await asyncio.sleep(0.01)
            stream = await client.responses.create(model=MODEL, input="hi", background=True, stream=True)
            events = []
            with pytest.raises(openai.APIError, match="engine is dead"):
                async for event in stream:
                    events.append(event)
            return failed, events
    failed, events = asyncio.run(go())
    assert failed.status == "failed" and "engine is dead" in failed.error.message
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]


def test_response_store_forgets_the_least_recently_used() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", [{"role": "user", "content": "1"}], {"id": "a"})
    store.put("b", [], {"id": "b"})
    assert store.history("a") == [{"role": "user", "content": "1"}]  # a is now the most recent
    store.put("c", [], {"id": "c"})
    assert store.body("b") is None and store.body("a") == {"id": "a"} and len(store) == 2
    store.history("a")[0]["content"] = "changed"  # callers get copies
    assert store.history("a") == [{"role": "user", "content": "1"}]


def test_reasoning_effort_reaches_the_template_and_include_reasoning_false_hides_it(
        tiny_tokenizer_dir: Path) -> None:
    """reasoning.effort -> the template's reasoning_effort and enable_thinking (as vLLM);
    vLLM's include_reasoning: false leaves the reasoning item out, whole and streamed."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    engine = ScriptedEngine(tokenizer, ["<think>hm", "m</think>", "Answer."])
    engine.tokenizer.chat_template = ("[{{ reasoning_effort }} {{ enable_thinking }}]"
                                      "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    options = ServerOptions(api_key=API_KEY, reasoning_parser="qwen3")

    async def go() -> tuple[Any, Any, list[Any]]:
        app = build_app(engine, [MODEL], options=options)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=http) as client:
            low = await client.responses.create(model=MODEL, input="hi", reasoning={"effort": "low"})
            hidden = await client.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"},
                                                   extra_body={"include_reasoning": False})
            stream = await client.responses.create(model=MODEL, input="hi", stream=True,
                                                   extra_body={"include_reasoning": False})
            return low, hidden, [event async for event in stream]

    low, hidden, events = asyncio.run(go())
    prompts = [tokenizer.decode(prompt["prompt_token_ids"]) for prompt in engine.prompts]
    assert prompts[0].startswith("[low True]hi") and prompts[1].startswith("[none False]hi"), prompts
    assert prompts[2].startswith("[ ]hi"), prompts  # no effort: the template sees neither
    assert [item.type for item in low.output] == ["reasoning", "message"] and low.reasoning.effort == "low"
    assert low.output[0].content[0].text == "hmm" and low.output_text == "Answer."
    assert [item.type for item in hidden.output] == ["message"] and hidden.output_text == "Answer."
    assert not any("reasoning" in event.type for event in events)
    assert [item.type for item in events[-1].response.output] == ["message"]
    assert events[-1].response.output_text == "Answer."
