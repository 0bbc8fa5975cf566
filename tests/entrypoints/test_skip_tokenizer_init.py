"""vLLM's `--skip-tokenizer-init` / `LLM(skip_tokenizer_init=True)`: no tokenizer is loaded; token
ids go in and come out (text ""), and what needs text is refused with a message naming it
(vLLM's tests/entrypoints/openai/completion/test_token_in_token_out.py and
tests/v1/engine/test_llm_engine.py::test_skip_tokenizer_initialization are the reference)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fake_engine import FakeEngine
from live_server import LiveServer, running_server

from vllm_lite import LLM, SamplingParams
from vllm_lite.entrypoints.openai.api_server import build_app
from vllm_lite.entrypoints.openai.server_state import ServerOptions

MODEL = "tiny-no-tokenizer"
API_KEY = "sk-no-tokenizer"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT_IDS = [11, 42, 7, 300, 5, 19]


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path) -> Iterator[LLM]:
    """The same model with its tokenizer: what the token-only engine must reproduce."""
    llm = LLM(str(tiny_qwen3), dtype="float32", max_model_len=128, num_kv_blocks=64)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tiny_qwen3, tmp_path_factory.mktemp("skip_tok") / "server.log", MODEL, API_KEY,
                        ("--max-model-len", "128", "--skip-tokenizer-init")) as live:
        yield live


def _post(server: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", json={"model": MODEL, **body}, timeout=60, headers=AUTH)


def _refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _greedy_ids(llm: LLM, prompt_ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return list(llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_token_ids_in_and_out_match_the_engine_with_a_tokenizer(server: LiveServer, reference: LLM) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=0.0, echo=True,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = reply.choices[0]
    assert choice.token_ids == _greedy_ids(reference, PROMPT_IDS, 8)
    assert choice.prompt_token_ids == PROMPT_IDS
    assert choice.text == ""  # nothing to decode with, as vLLM
    assert reply.usage.prompt_tokens == len(PROMPT_IDS) and reply.usage.completion_tokens == 8


def test_logprob_tokens_are_token_ids(server: LiveServer) -> None:
    reply = _post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 3, "temperature": 0.0,
                                               "logprobs": 2, "return_token_ids": True}).json()
    choice = reply["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "Hello there"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ("/tokenize", {"prompt": "Hello"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_what_needs_text_is_refused_by_name(server: LiveServer, route: str, body: dict, param: str) -> None:
    assert "--skip-tokenizer-init" in _refused(_post(server, route, {"max_tokens": 2, **body}
                                                       if route.startswith("/v1") else body), param)


def test_stop_strings_and_grammars_are_refused(server: LiveServer) -> None:
    base = {"prompt": PROMPT_IDS, "max_tokens": 2}
    stop = _post(server, "/v1/completions", {**base, "stop": ["\n"]})
    assert stop.status_code == 400 and "stop" in stop.json()["error"]["message"]
    grammar = _post(server, "/v1/completions", {**base, "structured_outputs": {"regex": "[ab]+"}})
    assert grammar.status_code == 400 and "skip_tokenizer_init" in grammar.json()["error"]["message"]
    # the refusals cost no other request anything
    assert _post(server, "/v1/completions", base).status_code == 200


def test_offline_llm_without_tokenizer(tiny_qwen3: Path, reference: LLM) -> None:
    llm = LLM(str(tiny_qwen3), dtype="float32", max_model_len=128, num_kv_blocks=64, skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="`skip_tokenizer_init=True`"):
            llm.generate("abc", SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="`skip_tokenizer_init=True`"):
            llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="stop strings"):
            llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=2, stop=["a"]), use_tqdm=False)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=True, prompt_logprobs=1)
        output = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
        assert output.outputs[0].text == ""
        assert list(output.outputs[0].token_ids) == _greedy_ids(reference, PROMPT_IDS, 6)
        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(PROMPT_IDS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("option, flag", [
    ({"reasoning_parser": "qwen3"}, "--reasoning-parser"),
    ({"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}, "--enable-auto-tool-choice"),
    ({"enable_tokenizer_info_endpoint": True}, "--enable-tokenizer-info-endpoint"),
])
def test_text_only_server_options_are_refused_at_start(tokenizer: Any, option: dict, flag: str) -> None:
    engine = FakeEngine(tokenizer, max_model_len=64)
    engine.tokenizer = None
    with pytest.raises(ValueError, match=flag):
        build_app(engine, options=ServerOptions(**option))
