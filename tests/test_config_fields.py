"""Config honesty: every field of a supported architecture's config is implemented, ignored as
irrelevant to the math, or refused with its name (vllm_lite/config_fields.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_lite.config import EngineArgs, HFModelConfig
from vllm_lite.config_fields import POLICIES
from vllm_lite.model.registry import supported_architectures


CONFIG_CLASS_NAMES = {"Gemma3ForCausalLM": "Gemma3TextConfig", "GPT2LMHeadModel": "GPT2Config",
                      "MPTForCausalLM": "MptConfig"}  # else <Family>Config


def _config_classes() -> dict[str, type]:
    import transformers

    return {arch: getattr(transformers, CONFIG_CLASS_NAMES.get(arch, arch.replace("ForCausalLM", "Config")))
            for arch in POLICIES}


def _attributes(config_cls: type) -> set[str]:
    """Every field a default instance carries: what it saves, what it holds, what it declares."""
    config = config_cls()
    names = set(config.to_dict()) | {n for n in vars(config) if not n.startswith("_")}
    for klass in config_cls.__mro__:
        if klass.__module__.startswith("transformers.models."):
            names |= {n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_")}
    return names - {"base_config_key", "sub_configs", "keys_to_ignore_at_inference",
                    "base_model_tp_plan", "base_model_pp_plan", "attribute_map", "model_type",
                    "default_theta"}


@pytest.mark.parametrize("architecture", sorted(POLICIES))
def test_every_transformers_config_field_is_classified(architecture: str) -> None:
    config_cls = _config_classes()[architecture]
    unclassified = _attributes(config_cls) - POLICIES[architecture].all_fields()
    assert not unclassified, (f"{config_cls.__name__} fields neither implemented, ignored nor "
                              f"refused in vllm_lite/config_fields.py: {sorted(unclassified)}")


def test_registry_and_policies_name_the_same_architectures() -> None:
    assert supported_architectures() == sorted(POLICIES)


def _tiny_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


REFUSED = [
    ("hidden_act", "gelu"),
    ("attn_logit_softcapping", 50.0),
    ("final_logit_softcapping", 30.0),
    ("quantization_config", {"quant_method": "gptq", "bits": 4}),
    ("rope_scaling", {"type": "dynamic", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("num_local_experts", 8),
    ("layer_types", ["full_attention", "sliding_attention"]),
    ("is_encoder_decoder", True),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_unimplemented_llama_field_is_refused_by_name(tiny_llama: Path, field: str, value: Any) -> None:
    cfg = _tiny_config(tiny_llama)
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        HFModelConfig.from_dict(cfg, {})


@pytest.mark.parametrize("fixture, field", [("tiny_llama", "num_attention_heads"), ("tiny_gpt2", "n_head"),
                                            ("tiny_codegen", "n_head")])  # native, native with aliases, fallback
def test_a_config_without_the_head_count_is_refused_by_name(fixture: str, field: str,
                                                            request: pytest.FixtureRequest) -> None:
    cfg = _tiny_config(request.getfixturevalue(fixture))
    del cfg[field]
    if fixture != "tiny_llama":  # (their defaults would fill it, as transformers': a value of the wrong type)
        cfg[field] = "4"
    with pytest.raises(ValueError, match="num_attention_heads missing or not an integer"):
        HFModelConfig.from_dict(cfg, {})


def test_unknown_rope_key_is_refused(tiny_llama: Path) -> None:
    cfg = _tiny_config(tiny_llama)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mscale": 0.7}
    with pytest.raises(ValueError, match="mscale"):
        HFModelConfig.from_dict(cfg, {})


def test_qwen2_reads_qkv_bias_as_transformers_does(tiny_qwen2: Path) -> None:
    cfg = _tiny_config(tiny_qwen2)
    cfg["attention_bias"] = False  # transformers' Qwen2 never reads it: q/k/v have biases
    assert HFModelConfig.from_dict(cfg, {}).attention_bias is True


def test_qwen_sliding_layers_follow_max_window_layers(tiny_qwen3: Path) -> None:
    cfg = _tiny_config(tiny_qwen3)
    cfg.pop("layer_types")  # as transformers does, an explicit list wins over max_window_layers
    cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert HFModelConfig.from_dict(cfg, {}).sliding_windows == (None, 8)
    cfg.update(use_sliding_window=False)
    assert HFModelConfig.from_dict(cfg, {}).sliding_windows == (None, None)
    cfg.update(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"])
    assert HFModelConfig.from_dict(cfg, {}).sliding_windows == (8, None)


def test_engine_refuses_a_model_with_an_unimplemented_field(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for path in tiny_llama.iterdir():
        (model_dir / path.name).symlink_to(path)
    cfg = _tiny_config(tiny_llama)
    cfg["final_logit_softcapping"] = 30.0
    (model_dir / "config.json").unlink()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        EngineArgs(model=str(model_dir)).create_engine_config()


REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "ffn_dim", "num_hidden_layers", "num_attention_heads")


@pytest.mark.parametrize("architecture", sorted(POLICIES))
def test_fields_left_out_read_as_transformers_defaults(architecture: str) -> None:
    """A config.json that leaves fields out means transformers' defaults for them."""
    full = _config_classes()[architecture]().to_dict()
    full["architectures"] = [architecture]
    minimal = {name: full[name] for name in ("architectures", *REQUIRED) if name in full}
    ours, theirs = HFModelConfig.from_dict(minimal, {}), HFModelConfig.from_dict(full, {})
    for name in HFModelConfig.__dataclass_fields__:
        if name not in ("raw", "eos_token_ids", "bos_token_id", "torch_dtype"):
            assert getattr(ours, name) == getattr(theirs, name), name
    for name in POLICIES[architecture].defaults:
        assert ours.raw[name] == theirs.raw[name], name


def test_auto_map_of_a_natively_supported_model_is_not_used(tiny_llama: Path) -> None:
    """Phi-3 and others still carry auto_map from their remote-code days; like transformers
    without trust_remote_code, the native implementation runs."""
    cfg = _tiny_config(tiny_llama)
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}
    assert HFModelConfig.from_dict(cfg, {}).model_impl == "vllm"


def test_longrope_past_the_original_context_is_refused(tiny_phi3: Path) -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings=256.*max_model_len <= 256"):
        EngineArgs(model=str(tiny_phi3), max_model_len=300).create_engine_config()


@pytest.mark.parametrize("fixture", ["tiny_falcon", "tiny_falcon_40b"])
def test_falcon_kv_heads_written_by_transformers_are_checked_against_its_layout(
        fixture: str, request: pytest.FixtureRequest) -> None:
    cfg = _tiny_config(request.getfixturevalue(fixture))
    derived = HFModelConfig.from_dict({k: v for k, v in cfg.items() if k != "num_key_value_heads"},
                                      {}).num_key_value_heads
    cfg["num_key_value_heads"] = derived  # as transformers >= 5.25 saves it
    assert HFModelConfig.from_dict(cfg, {}).num_key_value_heads == derived
    cfg["num_key_value_heads"] = derived + 1
    with pytest.raises(ValueError, match="num_key_value_heads=.* contradicts Falcon's layout"):
        HFModelConfig.from_dict(cfg, {})
