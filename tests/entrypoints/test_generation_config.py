"""vLLM's --generation-config: the model creator's sampling values in generation_config.json
(those that differ from transformers' defaults) are what a request leaves unset takes, on the
server and in `LLM.generate` without SamplingParams; `--generation-config vllm` turns them off, a
folder replaces the model's file, `--override-generation-config` goes on top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from checkpoint_copies import edited_copy
from live_server import running_server
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs, sampling_defaults

API_KEY = "sk-generation-config"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY_AND_SHORT = {"temperature": 0.0, "max_new_tokens": 5, "top_k": 50, "do_sample": True}


def with_generation_config(model: Path, tmp_path: Path, values: dict[str, Any]) -> Path:
    return edited_copy(model, tmp_path / "model", values, file="generation_config.json")


def test_the_recommended_values_are_those_that_differ_from_transformers_defaults() -> None:
    assert sampling_defaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True}, {}) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_defaults({"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}, {}) == {}
    assert sampling_defaults(GREEDY_AND_SHORT, {"top_p": 0.5}) == {"temperature": 0.0, "max_tokens": 5, "top_p": 0.5}
    with pytest.raises(ValueError, match=r"override_generation_config keys must be among .*got \['seed'\]"):
        sampling_defaults({}, {"seed": 3})
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_defaults({"top_p": 0.0}, {})


def test_sources_of_the_generation_config(tiny_llama: Path, tmp_path: Path) -> None:
    model = with_generation_config(tiny_llama, tmp_path, GREEDY_AND_SHORT)
    config = lambda **args: EngineArgs(model=str(model), device="cpu", **args).create_engine_config().model_config
    assert config().sampling_defaults == {"temperature": 0.0, "max_tokens": 5}
    assert config(generation_config="vllm").sampling_defaults == {}
    assert config(generation_config=str(tiny_llama)).sampling_defaults == {}  # another folder's file
    assert config(override_generation_config={"max_new_tokens": 9}).sampling_defaults == {
        "temperature": 0.0, "max_tokens": 9}
    with pytest.raises(ValueError, match="generation_config must be one of"):
        config(generation_config=str(tmp_path / "nowhere"))


def test_llm_generate_without_params_takes_the_models_values(tiny_llama: Path, tmp_path: Path,
                                                             prompts_token_ids: list[list[int]]) -> None:
    model = with_generation_config(tiny_llama, tmp_path, GREEDY_AND_SHORT)
    prompts = [{"prompt_token_ids": p} for p in prompts_token_ids[:3]]
    llm = make_llm(model)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        defaulted = [out.outputs[0].token_ids for out in llm.generate(prompts, use_tqdm=False)]
        greedy = [out.outputs[0].token_ids
                  for out in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)]
        assert defaulted == greedy and all(len(tokens) == 5 for tokens in defaulted)
    finally:
        llm.shutdown()
    plain = make_llm(model, generation_config="vllm")
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.shutdown()


def test_server_requests_take_the_models_values_where_they_leave_them_unset(tiny_llama: Path,
                                                                           tmp_path: Path) -> None:
    model = with_generation_config(tiny_llama, tmp_path, {"temperature": 0.0, "max_new_tokens": 6})
    with running_server(model, tmp_path / "server.log", "tiny", API_KEY, ("--max-model-len", "128")) as server:
        def complete(**fields: Any) -> dict[str, Any]:
            reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                               json={"model": "tiny", "prompt": "The river", **fields}, headers=AUTH)
            assert reply.status_code == 200, reply.text
            return reply.json()

        unset = complete(max_tokens=20)
        assert unset["usage"]["completion_tokens"] == 6  # the model's max_new_tokens caps a given max_tokens
        assert unset["choices"][0]["text"] == complete(max_tokens=6, temperature=0.0)["choices"][0]["text"]
        sampled = [complete(temperature=1.0, seed=seed)["choices"][0]["text"] for seed in range(4)]
        assert len(set(sampled)) > 1  # a request's own temperature wins
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, headers=AUTH).json()
        assert chat["usage"]["completion_tokens"] <= 6
    assert "generation-config sampling values {'temperature': 0.0, 'max_tokens': 6}" in (
        tmp_path / "server.log").read_text()


def test_the_flags_take_vllms_json_forms(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_lite.entrypoints.cli import build_parser
    from vllm_lite.entrypoints.cli_args import engine_args_from

    args = build_parser().parse_args(["serve", "--generation-config", "vllm",
                                      "--override-generation-config", '{"temperature": 0.5, "top_k": 8}'])
    engine_args = engine_args_from(args)
    assert engine_args.generation_config == "vllm"
    assert engine_args.override_generation_config == {"temperature": 0.5, "top_k": 8}
    for bad in ("[0.5]", "{temperature: 0.5}"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--override-generation-config", bad])
    assert "--override-generation-config" in capsys.readouterr().err
