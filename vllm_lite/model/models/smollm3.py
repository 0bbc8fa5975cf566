"""SmolLM3: the Llama block with no rotary embedding in some layers (config.json's
`no_rope_layers`: 1 rotates, 0 does not; when absent, every `no_rope_layer_interval`-th layer is
NoPE, transformers' default)."""

from __future__ import annotations

from vllm_lite.config import HFModelConfig
from vllm_lite.model.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def rope_layers(config: HFModelConfig) -> tuple[bool, ...]:
        raw, num_layers = config.raw, config.num_hidden_layers
        flags = raw.get("no_rope_layers")
        if flags is None:
            interval = int(raw.get("no_rope_layer_interval", 4))
            flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(flags) != num_layers or any(flag not in (0, 1) for flag in flags):
            raise ValueError(f"config.json: no_rope_layers must hold a 0 or 1 for each of the {num_layers} "
                             f"layers, got {flags!r}")
        return tuple(bool(flag) for flag in flags)
