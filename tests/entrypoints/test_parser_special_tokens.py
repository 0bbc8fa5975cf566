"""Parsers whose markers are special tokens of the tokenizer (Magistral's `[THINK]`, Mistral's
`[TOOL_CALLS]`, `<think>` where a tokenizer marks it special): the default skip_special_tokens
would take the markers out of the text before the parser reads it, so the server keeps special
tokens for requests that go through such a parser (vLLM's parsers' adjust_request) and refuses an
explicit `skip_special_tokens: true` there. A live server writes the replies token by token
(tests/custom_logits_processors.py:ForcedSequence), markers included."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hf_reference import build_tiny_model
from live_server import LiveServer, running_server
from transformers import AutoTokenizer

from vllm_lite.reasoning_tags import reasoning_markers, special_token_markers
from vllm_lite.entrypoints.openai.tool_parsers import TOOL_MARKERS, TOOL_PARSERS

KEY = "special-key"
MARKERS = ["<think>", "</think>", "[TOOL_CALLS]"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def marked_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose tokenizer has the markers as special tokens (ids 1000-1002)."""
    out = build_tiny_model(tmp_path_factory.mktemp("marked_qwen3"), "qwen3", tie_word_embeddings=True,
                           head_dim=32, extra_config={"vocab_size": 1000 + len(MARKERS)})
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(marked_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = ("--max-model-len", "256", "--reasoning-parser", "qwen3", "--tool-call-parser", "mistral",
            "--enable-auto-tool-choice", "--logits-processors", "tests.custom_logits_processors:ForcedSequence")
    with running_server(marked_model, tmp_path_factory.mktemp("special") / "server.log", "tiny", KEY, args) as live:
        yield live
    assert live.leftover_processes() == set()


@pytest.fixture(scope="module")
def tokenizer(marked_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(marked_model)


def _ids(tokenizer: Any, *pieces: str) -> list[int]:
    """The pieces' tokens in order, each marker as its one special token."""
    ids: list[int] = []
    for piece in pieces:
        ids += [tokenizer.convert_tokens_to_ids(piece)] if piece in MARKERS else tokenizer.encode(piece)
    return ids


def _chat(server: LiveServer, forced: list[int], **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60, json={"model": "tiny", "messages": ASK, "max_tokens": len(forced),
                                        "vllm_xargs": {"forced_tokens": forced}, **body})


def _streamed(server: LiveServer, forced: list[int], **body: Any) -> dict[str, Any]:
    """The deltas' reasoning, content and tool-call arguments, each joined."""
    joined: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60, json={"model": "tiny", "messages": ASK, "max_tokens": len(forced), "stream": True,
                                        "vllm_xargs": {"forced_tokens": forced}, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                joined["reasoning"] += delta.get("reasoning") or ""
                joined["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    function = joined["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    function["name"] += call.get("function", {}).get("name") or ""
                    function["arguments"] += call.get("function", {}).get("arguments") or ""
    return joined


def test_special_think_tags_reach_the_reasoning_parser(server: LiveServer, tokenizer: Any) -> None:
    forced = _ids(tokenizer, "<think>", "hmm, sunny", "</think>", "It is sunny.")
    reply = _chat(server, forced)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("hmm, sunny", "It is sunny.")
    assert reply.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(tokenizer.encode("hmm, sunny"))
    streamed = _streamed(server, forced)
    assert (streamed["reasoning"], streamed["content"]) == ("hmm, sunny", "It is sunny.")


def test_a_special_tool_call_marker_reaches_the_tool_parser(server: LiveServer, tokenizer: Any) -> None:
    calls = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    forced = _ids(tokenizer, "[TOOL_CALLS]", calls) + [tokenizer.eos_token_id]  # (a call cut by max_tokens is none)
    reply = _chat(server, forced, tools=[WEATHER])
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    function = choice["message"]["tool_calls"][0]["function"]
    assert (function["name"], json.loads(function["arguments"])) == ("get_weather", {"city": "Paris"})
    streamed = _streamed(server, forced, tools=[WEATHER])
    assert streamed["content"] == "" and streamed["calls"][0]["name"] == "get_weather"
    assert json.loads(streamed["calls"][0]["arguments"]) == {"city": "Paris"}


def test_without_tools_a_tool_marker_is_content(server: LiveServer, tokenizer: Any) -> None:
    """No tools: the tool parser reads nothing, and the marker shows as the special token it is
    (the reasoning parser's tags keep special tokens in this server's chat replies)."""
    forced = _ids(tokenizer, "[TOOL_CALLS]", "Paris")
    for body in ({}, {"skip_special_tokens": False}, {"tools": [WEATHER], "tool_choice": "none"}):
        reply = _chat(server, forced, **body)
        assert reply.status_code == 200, reply.text
        message = reply.json()["choices"][0]["message"]
        assert message["content"] == "[TOOL_CALLS]Paris" and not message.get("tool_calls"), body


def test_an_explicit_skip_special_tokens_true_is_refused_by_name(server: LiveServer, tokenizer: Any) -> None:
    reply = _chat(server, _ids(tokenizer, "Paris"), skip_special_tokens=True)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "skip_special_tokens" and "<think>" in error["message"]
    forced = _ids(tokenizer, "<think>", "Paris")
    completion = httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                            timeout=60, json={"model": "tiny", "prompt": "Hi", "max_tokens": len(forced),
                                              "skip_special_tokens": True, "vllm_xargs": {"forced_tokens": forced}})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "Paris"  # (no parser there)


def test_which_markers_are_special(tokenizer: Any, tiny_tokenizer_dir: Path) -> None:
    assert special_token_markers(tokenizer, reasoning_markers("qwen3")) == ("<think>", "</think>")
    assert special_token_markers(tokenizer, TOOL_MARKERS["mistral"]) == ("[TOOL_CALLS]",)
    plain = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert special_token_markers(plain, reasoning_markers("qwen3") + TOOL_MARKERS["hermes"]) == ()
    plain.add_tokens(["<tool_call>"])  # an added token that is not special stays in the text
    assert special_token_markers(plain, TOOL_MARKERS["hermes"]) == ()
    assert set(TOOL_MARKERS) == set(TOOL_PARSERS)


def test_responses_and_messages_keep_the_markers_too(server: LiveServer, tokenizer: Any) -> None:
    """The Responses and Anthropic Messages routes go through the same parsers."""
    forced = _ids(tokenizer, "<think>", "hmm", "</think>", "Sunny.")
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{server.base_url}/v1/responses", headers=headers, timeout=60, json={
        "model": "tiny", "input": "Weather?", "max_output_tokens": len(forced), "vllm_xargs": {"forced_tokens": forced}})
    assert response.status_code == 200, response.text
    reasoning, message = response.json()["output"]
    assert reasoning["content"][0]["text"] == "hmm" and message["content"][0]["text"] == "Sunny."
    refused = httpx.post(f"{server.base_url}/v1/responses", headers=headers, timeout=60, json={
        "model": "tiny", "input": "Weather?", "max_output_tokens": 4, "skip_special_tokens": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "skip_special_tokens"
    anthropic = httpx.post(f"{server.base_url}/v1/messages", headers=headers, timeout=60, json={
        "model": "tiny", "messages": ASK, "max_tokens": len(forced), "vllm_xargs": {"forced_tokens": forced}})
    assert anthropic.status_code == 200, anthropic.text
    blocks = anthropic.json()["content"]
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in blocks] == [("thinking", "hmm"), ("text", "Sunny.")]
