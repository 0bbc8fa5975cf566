"""More of vLLM's server surface (issue 14) against a live `vllm-lite serve`: logprob_token_ids,
/tokenizer_info, --root-path with --api-key, ORCA load headers and the refusal of unknown
request fields. The `openai` client where it types the call, raw HTTP for the rest."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer, running_server

MODEL = "tiny-qwen3"
API_KEY = "sk-conformance"
ROOT_PATH = "/llm"
PROMPT = "The quick brown fox jumps over"
CHAT = [{"role": "user", "content": "Tell me about the river."}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("conformance") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--enable-tokenizer-info-endpoint",
                         "--root-path", ROOT_PATH)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _post(server: LiveServer, route: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **body}, timeout=60,
                      headers={**AUTH, **(headers or {})})


def _error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _ids(top: dict[str, float] | list[Any]) -> list[int]:
    keys = top if isinstance(top, dict) else [entry.token for entry in top]
    return [int(key.removeprefix("token_id:")) for key in keys]


# ---- logprob_token_ids ----


def test_completion_logprob_token_ids_are_the_given_ids_with_their_logprobs(server: LiveServer) -> None:
    """Each position lists the sampled token and then exactly the given ids; given ids that are
    the natural top-3 carry the same logprobs as a plain logprobs=3 request."""
    base = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    plain = _post(server, "/v1/completions", {**base, "logprobs": 3}).json()["choices"][0]
    top3 = _ids(plain["logprobs"]["top_logprobs"][0])[1:4]  # the first entry is the sampled token
    given = [*top3, 5]
    asked = _post(server, "/v1/completions", {**base, "logprobs": 0, "logprob_token_ids": given}).json()
    choice = asked["choices"][0]
    assert choice["token_ids"] == plain["token_ids"]
    first = choice["logprobs"]["top_logprobs"][0]
    assert _ids(first) == list(dict.fromkeys([choice["token_ids"][0], *given]))
    plain_first = plain["logprobs"]["top_logprobs"][0]
    for key in (f"token_id:{t}" for t in top3):
        assert first[key] == pytest.approx(plain_first[key], abs=1e-5)
    assert first["token_id:5"] <= min(first[f"token_id:{t}"] for t in top3)
    for top, token_id in zip(choice["logprobs"]["top_logprobs"], choice["token_ids"]):
        assert _ids(top) == list(dict.fromkeys([token_id, *given]))
        assert all(math.isfinite(v) and v <= 0 for v in top.values())


def test_chat_logprob_token_ids_streaming_and_not(client: openai.OpenAI) -> None:
    given = [100, 999, 7]
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0, logprobs=True,
                  extra_body={"logprob_token_ids": given, "return_tokens_as_token_ids": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for position in content:
        sampled = int(position.token.removeprefix("token_id:"))
        assert _ids(position.top_logprobs) == list(dict.fromkeys([sampled, *given]))
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs and choice.logprobs.content
                for entry in choice.logprobs.content]
    assert [(e.token, [(t.token, t.logprob) for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


@pytest.mark.parametrize("route, body, fragment", [
    ("/v1/completions", {"prompt": PROMPT, "logprob_token_ids": [1]}, "`logprobs` must be set"),
    ("/v1/chat/completions", {"messages": CHAT, "logprob_token_ids": [1]}, "must be set to true"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": []}, "must not be an empty list"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": list(range(129))},
     "greater than max allowed: 128"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": [1, 10**7]},
     "[10000000] in logprob_token_ids contain out-of-vocab"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "logprob_token_ids": [1], "use_beam_search": True},
     "not supported with beam search"),
])
def test_logprob_token_ids_refusals(server: LiveServer, route: str, body: dict, fragment: str) -> None:
    assert fragment in _error(_post(server, route, body), "logprob_token_ids")


# ---- /tokenizer_info ----


def test_tokenizer_info(server: LiveServer, tiny_qwen3: Path) -> None:
    assert httpx.get(f"{server.base_url}/tokenizer_info", timeout=10).status_code == 401
    info = httpx.get(f"{server.base_url}/tokenizer_info", headers=AUTH, timeout=10).json()
    config = json.loads((tiny_qwen3 / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] and isinstance(info["tokenizer_class"], str)
    assert isinstance(info["chat_template"], str) and info["chat_template"].strip()
    for key in ("eos_token", "model_max_length"):
        if key in config:
            assert info[key] == config[key]
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    assert info.get("model_max_length", 10**9) >= _post(server, "/tokenize", {"prompt": "hi"}).json()["max_model_len"]


# ---- --root-path with --api-key (as vLLM's test_root_path) ----


@pytest.mark.parametrize("prefix", ["", ROOT_PATH])
@pytest.mark.parametrize("key, refused", [("wrong-key", True), (API_KEY, False)])
def test_root_path_with_api_key(server: LiveServer, prefix: str, key: str, refused: bool) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}{prefix}/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": "An apple a day, keeps"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    if refused:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra)
        return
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens == 4


def test_root_path_keeps_the_probes_open(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}{ROOT_PATH}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.base_url}{ROOT_PATH}/metrics", timeout=10).status_code == 401


# ---- ORCA load reports ----


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                                         ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})])
def test_orca_load_report_text_and_json(server: LiveServer, route: str, body: dict) -> None:
    plain = _post(server, route, body)
    assert plain.status_code == 200 and "endpoint-load-metrics" not in plain.headers
    text = _post(server, route, body, {"endpoint-load-metrics-format": "text"}).headers["endpoint-load-metrics"]
    assert text.startswith("TEXT ")
    fields = dict(item.split("=") for item in text[len("TEXT "):].split(", "))
    assert set(fields) == {"named_metrics.kv_cache_usage_perc", "named_metrics.num_requests_waiting"}
    assert 0.0 <= float(fields["named_metrics.kv_cache_usage_perc"]) <= 1.0
    report = _post(server, route, body, {"endpoint-load-metrics-format": "JSON"}).headers["endpoint-load-metrics"]
    assert report.startswith("JSON ")
    metrics = json.loads(report[len("JSON "):])["named_metrics"]
    assert set(metrics) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert all(isinstance(value, float) for value in metrics.values())


def test_orca_unknown_format_is_refused(server: LiveServer) -> None:
    response = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                     {"endpoint-load-metrics-format": "bin"})
    assert "text, json" in _error(response, "endpoint-load-metrics-format")


# ---- unknown request fields ----


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                                         ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
                                         ("/tokenize", {"prompt": PROMPT})])
def test_unknown_top_level_fields_are_refused_by_name(server: LiveServer, route: str, body: dict) -> None:
    message = _error(_post(server, route, {**body, "frobnicate": 1, "zeta": 2}), "frobnicate")
    assert "unknown fields: frobnicate, zeta" in message
    message = _error(_post(server, route, {**body, "logits_processors": ["x"]}), "logits_processors")
    assert "logits_processors is not supported" in message


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "a\ud83db", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "bad_words": ["\udc00"]}, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages"),
    ("/v1/responses", {"input": "hi \ud83d"}, "input"),
    ("/tokenize", {"prompt": "\ud83d"}, "prompt"),
])
def test_unpaired_surrogates_are_refused_by_field(server: LiveServer, route: str, body: dict, param: str) -> None:
    """JSON's "\\ud83d" escape decodes to half of a surrogate pair, which no text holds; the
    tokenizer would fail on it with an unrelated message."""
    def post_escaped(route: str, body: dict) -> httpx.Response:  # json.dumps writes \\uXXXX escapes
        return httpx.post(f"{server.base_url}{route}", content=json.dumps({"model": MODEL, **body}), timeout=60,
                          headers={**AUTH, "content-type": "application/json"})

    assert "unpaired UTF-16 surrogate" in _error(post_escaped(route, body), param)
    paired = post_escaped("/v1/completions", {"prompt": "ok \U0001f642", "max_tokens": 2})
    assert paired.status_code == 200, paired.text  # an escaped pair is one character (an emoji)


def test_openai_client_requests_with_every_common_field_pass(client: openai.OpenAI) -> None:
    """What the official client sends for ordinary calls is accepted."""
    common = dict(model=MODEL, max_tokens=3, temperature=0.5, top_p=0.9, n=2, stop=["\n\n"], seed=7,
                  presence_penalty=0.1, frequency_penalty=0.1, logit_bias={"5": -1}, user="u-1")
    completion = client.completions.create(prompt=PROMPT, logprobs=1, echo=False, best_of=2, **common)
    assert len(completion.choices) == 2
    chat = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=1, max_completion_tokens=3,
                                          **{k: v for k, v in common.items() if k != "max_tokens"})
    assert len(chat.choices) == 2
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, stream_options={"include_usage": True},
                                                 **common))
    assert chunks[-1].usage is not None


# ---- metrics counted as vLLM counts them ----


def _samples(server: LiveServer) -> dict[str, float]:
    """`name{labels}` -> value of every vllm: sample (labels as written, model_name and the one
    engine dropped)."""
    text = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            key, value = line.rsplit(" ", 1)
            key = key.replace(f'model_name="{MODEL}"', "").replace('engine="0"', "").replace(",,", ",")
            out[key.replace("{,", "{").replace(",}", "}").replace("{}", "")] = \
                float(value)
    return out


def test_engine_timed_metrics_count_as_vllms(server: LiveServer, client: openai.OpenAI) -> None:
    """Two requests of 5 tokens each: two observations per request histogram, 4 inter-token
    latencies each, every prompt token and generated token in iteration_tokens_total; decode =
    the request's inter-token latencies and inference = prefill + decode (engine-core times)."""
    before = _samples(server)
    prompt_tokens = 0
    for prompt in (PROMPT, "A river runs"):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0,
                                          extra_body={"ignore_eos": True})
        prompt_tokens += reply.usage.prompt_tokens
    after = _samples(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 2
    assert delta("vllm:request_time_per_output_token_seconds_count") == 2
    assert delta("vllm:request_params_n_count") == delta("vllm:request_params_max_tokens_count") == 2
    assert delta("vllm:request_params_max_tokens_sum") == 2 * 5
    assert delta("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + 2 * 5
    assert delta("vllm:request_decode_time_seconds_sum") == pytest.approx(
        delta("vllm:inter_token_latency_seconds_sum"), abs=1e-6)
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"), abs=1e-6)
    assert delta("vllm:request_prefill_time_seconds_sum") > 0
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:request_decode_time_seconds_sum") / 4, abs=1e-6)
    waiting = {reason: after[f'vllm:num_requests_waiting_by_reason{{reason="{reason}"}}']
               for reason in ("capacity", "deferred")}
    assert sum(waiting.values()) == after["vllm:num_requests_waiting"] == 0


# The names vLLM 0.32's /metrics test expects after one completion (all of them apply to vllm_lite).
VLLM_METRIC_NAMES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:iteration_tokens_total", "vllm:cache_config_info",
    "vllm:request_success_total", *(f"vllm:{histogram}_{suffix}" for suffix in ("sum", "bucket", "count")
                                     for histogram in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds")))


def test_every_metric_name_vllm_expects(server: LiveServer) -> None:
    _post(server, "/v1/completions", {"prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0.0})
    text = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=10).text
    assert [name for name in VLLM_METRIC_NAMES if name not in text] == []


@pytest.mark.parametrize("route, body, field, value", [
    ("/v1/chat/completions", {"messages": CHAT}, "logits_processors", []),
])
def test_vllm_fields_with_the_value_that_changes_nothing_pass(server: LiveServer, route: str, body: dict,
                                                              field: str, value: Any) -> None:
    assert _post(server, route, {**body, "max_tokens": 2, field: value}).status_code == 200
    assert "not supported" in _error(_post(server, route, {**body, "max_tokens": 2, field: not value}), field)


def test_off_by_default_usage_details_and_request_id(server: LiveServer) -> None:
    """Without --enable-prompt-tokens-details / --enable-request-id-headers (as vLLM):
    usage has no prompt_tokens_details and responses carry no X-Request-Id
    (tests/entrypoints/test_vllm_server_flags.py runs them on)."""
    reply = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, {"X-Request-Id": "mine"})
    assert reply.json()["usage"].get("prompt_tokens_details") is None
    assert "x-request-id" not in reply.headers


def test_cache_config_info_carries_vllms_capacity_labels(server: LiveServer) -> None:
    """vLLM's test_metrics_exist reads kv_cache_size_tokens and kv_cache_max_concurrency from
    these labels: the pool in tokens, and how many max_model_len requests it holds at once."""
    text = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    labels = dict(pair.split("=", 1) for pair in line[line.index("{") + 1:line.rindex("}")].split(","))
    labels = {key: value.strip('"') for key, value in labels.items()}
    blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    assert blocks > 0
    assert int(labels["kv_cache_size_tokens"]) == blocks * block_size
    assert float(labels["kv_cache_max_concurrency"]) == pytest.approx(blocks / -(-128 // block_size), abs=0.01)
    # (vLLM's KV-cache Grafana dashboard shows these, and selects by engine)
    assert (labels["engine"], labels["prefix_caching_hash_algo"], labels["num_cpu_blocks"]) == ("0", "sha256", "None")


@pytest.mark.parametrize("prompt", [None, ""])
def test_empty_prompt_gets_vllms_message(client: openai.OpenAI, prompt: str | None) -> None:
    with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must be provided and non-empty"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body={"prompt_embeds": []})


def test_prompt_embeds_need_the_flag(server: LiveServer) -> None:
    """vLLM's message, before the payload is read (served with --enable-prompt-embeds:
    test_prompt_embeds_server.py)."""
    reply = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_embeds": "AAAA"})
    assert "You must set `--enable-prompt-embeds` to input `prompt_embeds`" in _error(reply, "prompt_embeds")


def test_score_and_rerank_on_a_generating_model_are_400(server: LiveServer) -> None:
    """vLLM's message: the model does not support the Score API (here: only embedding models do)."""
    for route, body in (("/score", {"queries": "a", "documents": ["b"]}),
                        ("/rerank", {"query": "a", "documents": ["b"]})):
        assert "does not support Score API" in _error(_post(server, route, body), "model")
