"""vLLM's hf_overrides (config.json keys replaced before the model is built, native models and the
Transformers fallback alike; the replaced keys are checked like the file's own) and load_format
(auto / safetensors / gguf as the model is, and dummy: random weights without a checkpoint).
References: transformers on a copy of the model whose config.json has the overrides written in."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_copies import edited_copy
from hf_reference import build_prompts, hf_greedy
from llm_factory import make_llm
from vllm_lite import SamplingParams
from vllm_lite.config import EngineArgs
from vllm_lite.entrypoints.cli_args import add_engine_args, engine_args_from

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# far from the model's: greedy tokens change; transformers 5 saves rope_parameters beside a null
# rope_scaling, and a given rope_scaling wins over it
OVERRIDES = {"rope_theta": 3.0, "rms_norm_eps": 0.25, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}


def greedy(model: Path, prompts: list[list[int]], **engine_args) -> list[list[int]]:
    llm = make_llm(model, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture, overrides", [
    ("tiny_llama", OVERRIDES),
    ("tiny_gpt_neox", {"rotary_pct": 0.5, "layer_norm_eps": 0.25}),  # (Pythia's names)
    ("tiny_phi2", {"layer_norm_eps": 0.25}),
    ("tiny_cohere", {"layer_norm_eps": 0.25, "logit_scale": 0.5}),  # the Transformers fallback
])
def test_overrides_change_the_model_as_the_written_config_does(fixture: str, overrides: dict,
                                                               request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model: Path = request.getfixturevalue(fixture)
    prompts = build_prompts(model)[:2]
    written = hf_greedy(edited_copy(model, tmp_path / f"{model.name}-overridden", overrides), prompts, NEW_TOKENS)
    assert written != hf_greedy(model, prompts, NEW_TOKENS)  # the overrides matter
    assert greedy(model, prompts, hf_overrides=overrides) == written


@pytest.mark.parametrize("fixture, overrides", [
    ("tiny_phi2", {"partial_rotary_factor": 1.0}),  # beside rope_parameters' 0.5 (transformers takes that)
    ("tiny_gpt_neox", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}),  # rotary_pct 0.25
    ("tiny_gpt_neox", {"rotary_pct": 0.1}),  # 0.1 of 16 dimensions: 1
])
def test_partial_rotary_values_that_cannot_hold_are_refused(fixture: str, overrides: dict,
                                                            request: pytest.FixtureRequest) -> None:
    model: Path = request.getfixturevalue(fixture)
    with pytest.raises(ValueError, match="disagree|must be an even number"):
        EngineArgs(model=str(model), hf_overrides=overrides).create_engine_config()


def test_overrides_set_the_default_context_and_are_checked(tiny_llama: Path) -> None:
    def config(**overrides):
        return EngineArgs(model=str(tiny_llama), hf_overrides=overrides).create_engine_config()

    assert config(max_position_embeddings=96).model_config.max_model_len == 96
    with pytest.raises(ValueError, match="not_a_llama_key"):
        config(not_a_llama_key=1)
    with pytest.raises(ValueError, match="hf_overrides must be a dict of config.json keys"):
        EngineArgs(model=str(tiny_llama), hf_overrides=lambda c: c).create_engine_config()


def test_flags_take_json_and_a_format(tiny_llama: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--model", str(tiny_llama), "--hf-overrides", '{"rope_theta": 3.0}',
                                               "--load-format", "dummy"]))
    assert args.hf_overrides == {"rope_theta": 3.0} and args.load_format == "dummy"


def without_weights(model: Path, folder: Path) -> Path:
    copy = folder / f"{model.name}-no-weights"
    shutil.copytree(model, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return copy


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_cohere"])  # native, Transformers fallback
def test_dummy_weights_need_no_checkpoint_and_repeat(fixture: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    model = without_weights(request.getfixturevalue(fixture), tmp_path)
    with pytest.raises(Exception):  # a folder without weights does not load as a checkpoint
        greedy(model, [[1, 2, 3]])
    llm = make_llm(model, load_format="dummy")
    try:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        weights = [p for p in runner.model.parameters() if p.is_floating_point() and not p.is_meta]  # meta: packed
        assert weights and all(float(p.detach().abs().max()) <= 1e-3 for p in weights)
        assert any(float(p.detach().abs().max()) > 0 for p in weights)
        first = llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert greedy(model, [[1, 2, 3]], load_format="dummy") == [list(first)]  # the same seed, the same weights


@pytest.mark.parametrize(("load_format", "message"), [
    ("pt", "load_format must be one of"),
    ("gguf", "load_format='gguf', but the model is a safetensors folder"),
])
def test_formats_this_model_is_not_are_refused(tiny_llama: Path, load_format: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_llama), load_format=load_format).create_engine_config()


def test_safetensors_is_the_folders_format(tiny_llama: Path) -> None:
    config = EngineArgs(model=str(tiny_llama), load_format="safetensors").create_engine_config()
    assert config.model_config.load_format == "safetensors"
    prompts = build_prompts(tiny_llama)[:1]
    assert greedy(tiny_llama, prompts, load_format="safetensors") == hf_greedy(tiny_llama, prompts, NEW_TOKENS)
