"""Architecture name (config.json `architectures[0]`) -> model class, imported on use.
Configuration rejects an unknown architecture before any worker starts without importing this
layer: config_fields.py's per-architecture field policies are the same list (a test checks)."""

from __future__ import annotations

import importlib

_MODELS: dict[str, str] = {
    "BloomForCausalLM": "vllm_lite.model.models.bloom:BloomForCausalLM",
    "FalconForCausalLM": "vllm_lite.model.models.falcon:FalconForCausalLM",
    "GPT2LMHeadModel": "vllm_lite.model.models.gpt2:GPT2LMHeadModel",
    "GPTBigCodeForCausalLM": "vllm_lite.model.models.gpt2:GPTBigCodeForCausalLM",
    "GPTJForCausalLM": "vllm_lite.model.models.gptj:GPTJForCausalLM",
    "GPTNeoXForCausalLM": "vllm_lite.model.models.gpt_neox:GPTNeoXForCausalLM",
    "GemmaForCausalLM": "vllm_lite.model.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "vllm_lite.model.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "vllm_lite.model.models.gemma:Gemma3ForCausalLM",
    "GraniteForCausalLM": "vllm_lite.model.models.granite:GraniteForCausalLM",
    "LlamaForCausalLM": "vllm_lite.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "vllm_lite.model.models.llama:LlamaForCausalLM",
    "MPTForCausalLM": "vllm_lite.model.models.mpt:MptForCausalLM",
    "MixtralForCausalLM": "vllm_lite.model.models.moe:MixtralForCausalLM",
    "MptForCausalLM": "vllm_lite.model.models.mpt:MptForCausalLM",
    "OPTForCausalLM": "vllm_lite.model.models.opt:OPTForCausalLM",
    "OlmoForCausalLM": "vllm_lite.model.models.olmo:OlmoForCausalLM",
    "Olmo2ForCausalLM": "vllm_lite.model.models.olmo2:Olmo2ForCausalLM",
    "PhiForCausalLM": "vllm_lite.model.models.phi:PhiForCausalLM",
    "Phi3ForCausalLM": "vllm_lite.model.models.phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "vllm_lite.model.models.qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "vllm_lite.model.models.moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "vllm_lite.model.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "vllm_lite.model.models.moe:Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM": "vllm_lite.model.models.smollm3:SmolLM3ForCausalLM",
    "StableLmForCausalLM": "vllm_lite.model.models.stablelm:StableLmForCausalLM",
    "Starcoder2ForCausalLM": "vllm_lite.model.models.starcoder2:Starcoder2ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_supported(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(supported_architectures())}")


def get_model_class(architecture: str, model_impl: str = "vllm") -> type:
    if model_impl == "transformers":
        from vllm_lite.model.models.transformers_fallback import TransformersForCausalLM

        return TransformersForCausalLM
    check_supported(architecture)
    module_name, class_name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)
