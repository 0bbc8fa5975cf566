"""Structured outputs through a live `vllm-lite serve` (tiny Qwen3, its engine core in its own
process) and the official `openai` client: response_format json_object / json_schema, vLLM's
structured_outputs and guided_* fields, invalid specs and conflicting fields as 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_server import LiveServer, running_server
from structured_checks import CHOICES, PERSON_SCHEMA, REGEX, KINDS

MODEL = "tiny-qwen3"
API_KEY = "sk-structured"
CHAT = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "256")) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    """Free whitespace is allowed between JSON tokens (a random model may spend its budget on
    it): a finished output follows the schema, a cut one is the start of an object."""
    finished = 0
    for seed in range(4):
        out = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}})
        choice = out.choices[0]
        if choice.finish_reason == "stop":
            finished += 1
            assert KINDS["json"][1](choice.message.content), choice.message.content
        else:
            assert choice.message.content.startswith("{"), choice.message.content
    compact = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, seed=9,
        extra_body={"structured_outputs": {"json": PERSON_SCHEMA, "disable_any_whitespace": True}})
    assert compact.choices[0].finish_reason == "stop"
    assert KINDS["json"][1](compact.choices[0].message.content), compact.choices[0].message.content


def test_response_format_json_object_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=0.0,
                                            response_format={"type": "json_object"}, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text, strict=False), dict), text
    else:  # cut by max_tokens: still the start of an object
        assert text.startswith("{"), text


def test_legacy_guided_fields_constrain(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Color:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_choice": CHOICES})
    assert out.choices[0].text in CHOICES
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=40, temperature=0.0,
                                    extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, out.choices[0].text), out.choices[0].text
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=0.0,
                                         extra_body={"guided_json": PERSON_SCHEMA})
    text = out.choices[0].message.content
    assert KINDS["json"][1](text) if out.choices[0].finish_reason == "stop" else text.startswith("{"), text
    out = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=60, temperature=0.0,
                                    extra_body={"structured_outputs": {"grammar": KINDS["grammar"][0].grammar}})
    assert KINDS["grammar"][1](out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"guided_json": {"type": "no-such-type"}}, "guided_json", "structured_outputs.json is invalid"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "structured_outputs.regex is invalid"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "structured_outputs.grammar is invalid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "structured_outputs.json is invalid"),
    ({"structured_outputs": {"regex": "a", "whitespace_patern": "x"}}, "structured_outputs", "whitespace_patern"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "only one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "outlines"),
    ({"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern", "not supported"),
])
def test_bad_structured_requests_are_400(client: openai.OpenAI, body: dict, param: str, words: str) -> None:
    """Each is a 400 whose `param` names the field that asked (an invalid spec included)."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body=body)
    error = info.value.body
    assert words in error["message"], error
    assert error.get("param") == param, error
    # the server still answers
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
