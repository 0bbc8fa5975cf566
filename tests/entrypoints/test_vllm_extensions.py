"""vLLM's OpenAI-server extensions (issue 14) against a live `vllm-lite serve`: token ids in
and out, logprob tokens as ids, truncate_prompt_tokens, prompt_logprobs and echo with logprobs.
Raw HTTP for the fields the `openai` client does not type, the client where it does."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer, running_server
from transformers import AutoTokenizer

MODEL = "tiny-qwen3"
API_KEY = "sk-ext-test"
MAX_MODEL_LEN = 128
PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("ext_server") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", str(MAX_MODEL_LEN))) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_qwen3)


def _post(server: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def _stream_chunks(server: LiveServer, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{server.base_url}{route}", json={"model": MODEL, "stream": True, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- token ids in and out ----


def test_completion_return_token_ids(server: LiveServer, tokenizer: Any) -> None:
    data = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
                                             "return_token_ids": True}).json()
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"] == 12
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    plain = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}).json()
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0]["prompt_token_ids"] is None


def test_completion_token_id_prompt_round_trips(server: LiveServer, client: openai.OpenAI) -> None:
    first = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                                              "return_token_ids": True}).json()["choices"][0]
    again = client.completions.create(model=MODEL, prompt=first["prompt_token_ids"], max_tokens=6, temperature=0.0,
                                      extra_body={"return_token_ids": True}).choices[0]
    assert again.token_ids == first["token_ids"] and again.prompt_token_ids == first["prompt_token_ids"]


def test_streamed_token_ids_equal_the_whole_response(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, "return_token_ids": True}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    chunks = _stream_chunks(server, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]


def test_stream_interval_sends_tokens_in_batches(server: LiveServer) -> None:
    """vLLM's stream_interval: the first token at once, then a chunk every 4 tokens, the rest
    with the end; the chunks add up to the unstreamed response (text, ids and logprobs)."""
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": 1}
    whole = _post(server, "/v1/completions", body).json()["choices"][0]
    chunks = _stream_chunks(server, "/v1/completions", {**body, "stream_interval": 4})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [len(c["token_ids"]) for c in choices] == [1, 4, 4, 1]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert [t for c in choices for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]


def test_stream_interval_in_chat(server: LiveServer) -> None:
    body = {"messages": CHAT, "max_tokens": 9, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    whole = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    chunks = _stream_chunks(server, "/v1/chat/completions", {**body, "stream_interval": 3})
    sizes = [len(ch["token_ids"]) for c in chunks for ch in c["choices"] if ch.get("token_ids")]
    assert sizes == [1, 3, 3, 2]
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == whole["message"]["content"]


@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_bad_stream_interval_is_refused_by_name(server: LiveServer, value: Any) -> None:
    response = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                                 "stream_interval": value})
    _error(response, "stream_interval")


def test_chat_return_token_ids_prompt_ids_at_response_level(server: LiveServer, tokenizer: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    data = _post(server, "/v1/chat/completions", body).json()
    templated = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert data["prompt_token_ids"] == tokenizer.encode(templated, add_special_tokens=False)
    assert len(data["prompt_token_ids"]) == data["usage"]["prompt_tokens"]
    choice = data["choices"][0]
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"]
    chunks = _stream_chunks(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == data["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == choice["token_ids"]


def test_chat_return_prompt_text_and_session_id(server: LiveServer, tokenizer: Any) -> None:
    """vLLM 0.32's `return_prompt_text`: the prompt the chat template made, at the response level
    (streamed: on the first chunk only); `session_id` (a KV-event label in vLLM) is taken."""
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0.0, "return_prompt_text": True, "session_id": "s-1"}
    data = _post(server, "/v1/chat/completions", body).json()
    assert data["prompt_text"] == tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chunks = _stream_chunks(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_text"] == data["prompt_text"] and all("prompt_text" not in c for c in chunks[1:])
    assert _post(server, "/v1/chat/completions", {**body, "return_prompt_text": None}).json()["prompt_text"] is None
    completion = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "session_id": "s-1"})
    assert completion.status_code == 200
    _error(_post(server, "/v1/chat/completions/batch", {**body, "messages": [CHAT]}), "return_prompt_text")


def test_return_tokens_as_token_ids(server: LiveServer) -> None:
    data = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 2,
                                             "return_token_ids": True, "return_tokens_as_token_ids": True}).json()
    choice = data["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for top in choice["logprobs"]["top_logprobs"]:
        assert all(key.startswith("token_id:") and key[len("token_id:"):].isdigit() for key in top)
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0.0,
                                                  "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                                                  "return_tokens_as_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    # vLLM's bytes: the sampled token's are those of its text (a client rebuilds the reply from them).
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == chat["message"]["content"]


def test_logprobs_minus_one_is_the_whole_vocabulary_and_above_max_logprobs(server: LiveServer) -> None:
    # -1 asks for every token's logprob; the server's max_logprobs (20) is smaller than the vocabulary.
    message = _error(_post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": -1}),
                     "logprobs")
    assert "20" in message
    _error(_post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True,
                                                  "top_logprobs": -1}), "logprobs")
    message = _error(_post(server, "/v1/chat/completions", {"messages": CHAT, "logprobs": True,
                                                            "top_logprobs": -5}), "top_logprobs")
    assert "positive value or -1" in message


@pytest.mark.parametrize("side, keep", [(None, slice(-3, None)), ("left", slice(-3, None)), ("right", slice(0, 3))])
def test_truncate_prompt_tokens(server: LiveServer, tokenizer: Any, side: str | None, keep: slice) -> None:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "truncate_prompt_tokens": 3,
                            "return_token_ids": True}
    if side is not None:
        body["truncation_side"] = side
    data = _post(server, "/v1/completions", body).json()
    expected = tokenizer.encode(PROMPT)[keep]
    assert data["choices"][0]["prompt_token_ids"] == expected and data["usage"]["prompt_tokens"] == 3
    direct = _post(server, "/v1/completions", {"prompt": expected, "max_tokens": 4, "temperature": 0.0}).json()
    assert direct["choices"][0]["text"] == data["choices"][0]["text"]


def test_truncate_prompt_tokens_lets_a_too_long_prompt_in_and_checks_its_range(server: LiveServer) -> None:
    long_prompt = list(range(10, 10 + MAX_MODEL_LEN + 40))
    data = _post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1,
                                             "truncate_prompt_tokens": 100}).json()
    assert data["usage"]["prompt_tokens"] == 100
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "truncate_prompt_tokens": 5,
                                                  "return_token_ids": True}).json()
    assert chat["usage"]["prompt_tokens"] == 5 and len(chat["prompt_token_ids"]) == 5
    message = _error(_post(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}),
                     "truncate_prompt_tokens")
    assert f"max_model_len ({MAX_MODEL_LEN})" in message
    response = _post(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": -2})
    assert response.status_code == 400 and "truncate_prompt_tokens" in response.text


# ---- prompt_logprobs and echo with logprobs ----


def test_completion_prompt_logprobs_choice_level(server: LiveServer, client: openai.OpenAI, tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                         extra_body={"prompt_logprobs": 3})
    prompt_logprobs = response.choices[0].prompt_logprobs
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(prompt_ids[1:], prompt_logprobs[1:]):
        entry = {int(k): v for k, v in entry.items()}
        assert token_id in entry and 3 <= len(entry) <= 4  # the prompt token plus the top 3
        ranked = sorted((v for v in entry.values() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == [1, 2, 3]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"] >= ranked[2]["logprob"]
        assert entry[token_id]["decoded_token"] == tokenizer.decode([token_id])
        total = sum(math.exp(v["logprob"]) for v in ranked)
        assert 0 < total <= 1.0 + 1e-4


def test_chat_prompt_logprobs_response_level(server: LiveServer) -> None:
    data = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert len(data["prompt_logprobs"]) == data["usage"]["prompt_tokens"]
    assert data["prompt_logprobs"][0] is None and all(len(e) == 1 for e in data["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in data["choices"][0]


def test_chat_echo_carries_the_prompt_logprobs(server: LiveServer) -> None:
    """vLLM's rule: with echo and no prompt_logprobs, top_logprobs of them (0: each prompt
    token's own logprob); a stream carries none."""
    echoed = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "echo": True}).json()
    asked = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert echoed["prompt_logprobs"] == asked["prompt_logprobs"] and len(echoed["prompt_logprobs"]) > 1
    with_top = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "echo": True,
                                                      "logprobs": True, "top_logprobs": 2}).json()
    assert all(2 <= len(entry) <= 3 for entry in with_top["prompt_logprobs"][1:])
    plain = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    assert plain["prompt_logprobs"] is None
    chunks = _stream_chunks(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "echo": True})
    assert all(chunk.get("prompt_logprobs") is None for chunk in chunks)


def test_prompt_logprobs_keep_their_text_with_tokens_as_ids(server: LiveServer, tokenizer: Any) -> None:
    """return_tokens_as_token_ids is the `logprobs` fields' (vLLM): prompt_logprobs' decoded_token stays text."""
    prompt_ids = tokenizer.encode(PROMPT)
    for route, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        data = _post(server, route, {**body, "max_tokens": 1, "prompt_logprobs": 1, "logprobs": 1 if "prompt" in body
                                     else True, "return_tokens_as_token_ids": True}).json()
        entries = data["choices"][0]["prompt_logprobs"] if "prompt" in body else data["prompt_logprobs"]
        for entry in entries[1:]:  # (a token ending inside a UTF-8 character has its completed text, or "")
            assert all(v["decoded_token"] == tokenizer.decode([int(k)]) or tokenizer.decode([int(k)]).endswith("\ufffd")
                       for k, v in entry.items())
        if "prompt" in body:
            assert [int(next(iter(e))) for e in entries[1:]] == prompt_ids[1:]
            assert data["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 100}),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "stream": True}),
])
def test_bad_prompt_logprobs_are_400(server: LiveServer, route: str, body: dict[str, Any]) -> None:
    _error(_post(server, route, body), "prompt_logprobs")


def test_echo_with_logprobs_covers_the_prompt(server: LiveServer, tokenizer: Any) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    data = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "echo": True,
                                             "logprobs": 2, "return_token_ids": True}).json()
    choice, n_prompt = data["choices"][0], len(prompt_ids)
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(logprobs["tokens"]) == n_prompt + 5
    assert logprobs["tokens"][:n_prompt] == [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # The echoed tokens' logprobs are the prompt logprobs of the same prompt.
    with_prompt = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}).json()
    expected = [entry[str(t)]["logprob"] for t, entry in zip(prompt_ids[1:], with_prompt["choices"][0]["prompt_logprobs"][1:])]
    assert logprobs["token_logprobs"][1:n_prompt] == pytest.approx(expected, abs=1e-4)
    # vLLM's: the choice also carries those prompt logprobs (echo asks logprobs=2 of them).
    echoed_entries = choice["prompt_logprobs"]
    assert echoed_entries[0] is None and len(echoed_entries) == n_prompt
    assert [int(next(iter(e))) for e in echoed_entries[1:]] == prompt_ids[1:] and all(2 <= len(e) <= 3 for e in echoed_entries[1:])
    # Streaming gives the same tokens and logprobs.
    chunks = _stream_chunks(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0,
                                                        "echo": True, "logprobs": 2})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [t for s in streamed for t in s["tokens"]] == logprobs["tokens"]
    assert [v for s in streamed for v in s["token_logprobs"]] == pytest.approx(logprobs["token_logprobs"], abs=1e-4)


# ---- usage in streams ----


def test_continuous_usage_stats_on_every_completion_chunk(server: LiveServer) -> None:
    chunks = _stream_chunks(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    seen = 0
    for chunk in content:
        seen += len(chunk["choices"][0]["token_ids"])
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"] and usage["completion_tokens"] == seen
        assert usage["total_tokens"] == usage["prompt_tokens"] + seen


def test_continuous_usage_stats_in_chat_counts_per_choice(server: LiveServer) -> None:
    chunks = _stream_chunks(server, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 5, "n": 2, "seed": 3, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *content, last = chunks
    assert last["usage"]["completion_tokens"] == 10
    seen = [0, 0]
    for chunk in content:
        choice = chunk["choices"][0]
        seen[choice["index"]] += len(choice.get("token_ids") or [])
        assert chunk["usage"]["completion_tokens"] == seen[choice["index"]]
        assert chunk["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"]
    assert seen == [5, 5]


def test_no_usage_chunk_unless_asked(server: LiveServer) -> None:
    """vLLM 0.32: include_usage defaults to false, also inside a given stream_options."""
    for options in (None, {}, {"continuous_usage_stats": True}):
        body = {"prompt": PROMPT, "max_tokens": 3, **({"stream_options": options} if options is not None else {})}
        chunks = _stream_chunks(server, "/v1/completions", body)
        assert all("usage" not in chunk for chunk in chunks), options
    chunks = _stream_chunks(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                        "stream_options": {"include_usage": False,
                                                                           "continuous_usage_stats": True}})
    assert all("usage" not in chunk for chunk in chunks)


def test_enable_force_include_usage(tiny_qwen3: Path, tmp_path: Path) -> None:
    live = LiveServer(tiny_qwen3, tmp_path / "server.log", MODEL, API_KEY,
                      ("--max-model-len", str(MAX_MODEL_LEN), "--enable-force-include-usage"))
    try:
        live.wait_healthy()
        # vLLM 0.32: the flag means usage on every chunk (continuous) and a final usage chunk
        chunks = _stream_chunks(live, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        assert all("usage" in chunk for chunk in chunks)
        assert chunks[-2]["usage"]["completion_tokens"] == 4
        chunks = _stream_chunks(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                                          "stream_options": {"include_usage": False}})
        assert chunks[-1]["usage"]["completion_tokens"] == 4 and all("usage" in chunk for chunk in chunks)
    finally:
        live.stop()
        live.kill_group()


def test_invocations_on_the_real_engine_equals_the_routes_it_dispatches_to(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0}
    via = _post(server, "/invocations", body).json()
    assert via["choices"][0]["text"] == _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0.0}
    via = _post(server, "/invocations", chat).json()
    direct = _post(server, "/v1/chat/completions", chat).json()
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]


# ---- beam search ----


def test_use_beam_search_equals_llm_beam_search(server: LiveServer, tiny_qwen3: Path) -> None:
    from llm_factory import make_llm

    from vllm_lite.entrypoints.beam_search import BeamSearchParams

    body = {"prompt": PROMPT, "max_tokens": 6, "n": 3, "use_beam_search": True, "ignore_eos": True}
    data = _post(server, "/v1/completions", body).json()
    assert len(data["choices"]) == 3
    assert _post(server, "/v1/completions", body).json()["choices"] == data["choices"]  # deterministic
    llm = make_llm(tiny_qwen3, max_model_len=MAX_MODEL_LEN)
    try:
        offline = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
        tokenizer = llm.get_tokenizer()
    finally:
        llm.shutdown()
    # (LLM.beam_search's text is the whole sequence's, as vLLM's; a server choice's, the output's)
    prompt_len = len(tokenizer.encode(PROMPT))
    assert [c["text"] for c in data["choices"]] == [tokenizer.decode(s.tokens[prompt_len:], skip_special_tokens=True)
                                                    for s in offline.sequences]
    assert all(s.text.startswith(PROMPT) for s in offline.sequences)
    assert data["usage"]["completion_tokens"] == 18
    greedy = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                                               "ignore_eos": True}).json()["choices"][0]["text"]
    one = _post(server, "/v1/completions", {**body, "n": 1}).json()["choices"][0]["text"]
    assert one == greedy


def test_use_beam_search_in_chat_and_streaming(server: LiveServer) -> None:
    body = {"messages": CHAT, "max_tokens": 5, "n": 2, "use_beam_search": True, "length_penalty": 0.5}
    data = _post(server, "/v1/chat/completions", body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1] and data["usage"]["completion_tokens"] <= 10
    chunks = _stream_chunks(server, "/v1/chat/completions", body)
    streamed = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                        if c["choices"] and c["choices"][0]["index"] == i) for i in range(2)]
    assert streamed == [c["message"]["content"] for c in data["choices"]]


@pytest.mark.parametrize("extra, param", [({"stop": ["x"]}, "stop"), ({"logprobs": 2}, "logprobs"),
                                          ({"top_p": 0.5}, "top_p")])
def test_use_beam_search_refuses_fields_it_does_not_use(server: LiveServer, extra: dict, param: str) -> None:
    message = _error(_post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "use_beam_search": True,
                                                       **extra}), param)
    assert "use_beam_search" in message


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT}),
                                         ("/v1/chat/completions", {"messages": CHAT})])
def test_length_penalty_without_beam_search_is_refused(server: LiveServer, route: str, body: dict) -> None:
    """It scores beams only: a sampled request would drop it unread (as vLLM does), so it is refused."""
    message = _error(_post(server, route, {**body, "max_tokens": 3, "length_penalty": 2.0}), "length_penalty")
    assert "use_beam_search" in message
    assert _post(server, route, {**body, "max_tokens": 3, "length_penalty": 1.0}).status_code == 200


# ---- batched chat ----


def test_batch_chat_answers_each_conversation_as_chat_does(server: LiveServer) -> None:
    conversations = [CHAT, [{"role": "user", "content": "And the mountain?"}]]
    body = {"messages": conversations, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True}
    data = _post(server, "/v1/chat/completions/batch", body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    singles = [_post(server, "/v1/chat/completions", {**body, "messages": conversation}).json()
               for conversation in conversations]
    assert [c["message"]["content"] for c in data["choices"]] == [s["choices"][0]["message"]["content"] for s in singles]
    assert [c["token_ids"] for c in data["choices"]] == [s["choices"][0]["token_ids"] for s in singles]
    assert data["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert data["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    _error(_post(server, "/v1/chat/completions/batch", {**body, "stream": True}), "stream")
    _error(_post(server, "/v1/chat/completions/batch", {**body, "n": 2}), "n")
    _error(_post(server, "/v1/chat/completions/batch", {**body, "messages": []}), "messages")


# ---- metrics ----


def test_metrics_use_only_vllms_names_under_vllm_prefix(server: LiveServer) -> None:
    _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    text = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    assert "vllm:e2e_request_latency_seconds_count" in names and "vllm:request_prompt_tokens_sum" in names
    assert 'block_size="' in next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info"))
    assert not any("hit_rate" in name or "aborted" in name for name in names)


def test_request_id_names_the_response_and_the_header_wins(server: LiveServer) -> None:
    """vLLM's rule: the response id is the endpoint's prefix and the X-Request-Id header's id, else
    the body's request_id, else a random one. Two requests in flight may carry the same id."""
    completion = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "request_id": "trace-7"})
    assert completion.status_code == 200 and completion.json()["id"] == "cmpl-trace-7"
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "request_id": "trace-8"})
    assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-trace-8"
    streamed = _stream_chunks(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "request_id": "s-1"})
    assert {chunk["id"] for chunk in streamed} == {"chatcmpl-s-1"}
    header = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "request_id": "body"},
                        headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "from-header"})
    assert header.status_code == 200 and header.json()["id"] == "cmpl-from-header"
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "request_id": "same"}
    with ThreadPoolExecutor(2) as pool:  # both in flight at once: the engine's ids stay distinct
        replies = list(pool.map(lambda _: _post(server, "/v1/completions", body), range(2)))
    assert [reply.status_code for reply in replies] == [200, 200], [reply.text for reply in replies]
    assert replies[0].json()["id"] == replies[1].json()["id"] == "cmpl-same"
    assert replies[0].json()["choices"][0]["text"] == replies[1].json()["choices"][0]["text"]
    assert _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).json()["id"].startswith("cmpl-")


def test_request_id_is_the_responses_id_and_its_store_key(server: LiveServer) -> None:
    """vLLM's Responses API: the body's request_id is the response's id as given (no prefix), and
    the stored response is found and continued under it."""
    first = _post(server, "/v1/responses", {"input": PROMPT, "max_output_tokens": 2, "request_id": "conv-1"})
    assert first.status_code == 200 and first.json()["id"] == "conv-1", first.text
    stored = httpx.get(f"{server.base_url}/v1/responses/conv-1", headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=10)
    assert stored.status_code == 200 and stored.json()["id"] == "conv-1"
    follow = _post(server, "/v1/responses", {"input": "more", "max_output_tokens": 2, "previous_response_id": "conv-1"})
    assert follow.status_code == 200 and follow.json()["id"].startswith("resp_")
    assert "request_id" in _error(_post(server, "/v1/responses", {"input": PROMPT, "request_id": "x" * 257}),
                                  "request_id")


@pytest.mark.parametrize("value", ["", "x" * 257])
def test_bad_request_id_is_refused_with_the_limit(server: LiveServer, value: str) -> None:
    reply = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "request_id": value})
    assert "1 to 256 characters" in _error(reply, "request_id")


def test_bad_words_are_not_generated(server: LiveServer) -> None:
    """The first two tokens of the plain completion, as a word: with bad_words, the output no
    longer spells it with them (vLLM's field; the rule against transformers: tests/sample/test_bad_words.py)."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]
    word = _post(server, "/detokenize", {"tokens": plain["token_ids"][:2]}).json()["prompt"]
    banned = _post(server, "/v1/completions", {**body, "bad_words": [word]})
    assert banned.status_code == 200, banned.text
    tokens = banned.json()["choices"][0]["token_ids"]
    assert tokens[0] == plain["token_ids"][0] and tokens[1] != plain["token_ids"][1]
    assert "non-empty strings" in _error(_post(server, "/v1/chat/completions",
                                               {"messages": CHAT, "bad_words": ["ok", ""]}), "bad_words")
    assert "cannot be used with use_beam_search" in _error(
        _post(server, "/v1/completions", {**body, "bad_words": ["x"], "use_beam_search": True}), "bad_words")


def test_allowed_token_ids_keep_the_output_to_them(server: LiveServer) -> None:
    allowed = [3, 11, 17]
    reply = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
                                              "allowed_token_ids": allowed, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    assert set(reply.json()["choices"][0]["token_ids"]) <= set(allowed)
    assert "non-empty" in _error(_post(server, "/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": []}),
                                 "allowed_token_ids")
