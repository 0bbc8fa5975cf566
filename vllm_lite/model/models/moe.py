"""Mixture-of-experts decoders on the Llama block: Mixtral (every layer sparse, top-k always
renormalised), Qwen3-MoE (qk-norm, `norm_topk_prob`, dense layers per `mlp_only_layers` /
`decoder_sparse_step`) and Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B: Qwen3-MoE's routing with q/k/v
biases instead of qk-norm, and a shared expert beside the routed ones, gated per token by a
sigmoid). The experts run as one grouped computation (layers/fused_moe.py)."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import TensorParallelGroup
from vllm_lite.model.layers.fused_moe import FusedMoE, RouterLinear
from vllm_lite.model.models.llama import LlamaForCausalLM, LlamaMLP

_EXPERT_SHARDS = {"w1": "gate", "w3": "up", "w2": "down",
                  "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def num_experts(config: HFModelConfig) -> int:
    raw = config.raw
    count = raw.get("num_local_experts")  # transformers 5's name; hub Qwen3-MoE configs: num_experts
    return int(count if count is not None else raw.get("num_experts", 0))


def _expert_name(name: str, moe_fragment: str) -> tuple[str, Any] | None:
    """`...{moe_fragment}.experts.{e}.{proj}.weight` -> (`...mlp.w13|w2`, (which, e)); the
    experts stacked in one tensor (Qwen3-VL-MoE's `...experts.gate_up_proj` / `down_proj`) ->
    (`...mlp.w13|w2`, ("gate_up" | "down", None))."""
    stacked = re.search(rf"\.{moe_fragment}\.experts\.(gate_up_proj|down_proj)$", name)
    if stacked is not None:
        param, which = ("w13", "gate_up") if stacked.group(1) == "gate_up_proj" else ("w2", "down")
        return f"{name[:stacked.start()]}.mlp.{param}", (which, None)
    match = re.search(rf"\.{moe_fragment}\.experts\.(\d+)\.(\w+)\.weight$", name)
    if match is None:
        return None
    which = _EXPERT_SHARDS.get(match.group(2))
    if which is None:
        raise ValueError(f"checkpoint tensor {name!r}: unknown expert projection {match.group(2)!r}")
    param = "w2" if which == "down" else "w13"
    return f"{name[:match.start()]}.mlp.{param}", (which, int(match.group(1)))


class MixtralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def build_mlp(config: HFModelConfig, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return FusedMoE(num_experts(config), config.raw["num_experts_per_tok"], config.hidden_size,
                        config.intermediate_size, renormalize=True, tp=tp)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        expert = _expert_name(name, "block_sparse_moe")
        if expert is not None:
            return expert
        if ".block_sparse_moe.gate." in name:
            return name.replace(".block_sparse_moe.gate.", ".mlp.gate."), None
        return None


def qwen3_moe_is_sparse(config: HFModelConfig, layer_idx: int) -> bool:
    raw = config.raw
    return (layer_idx not in (raw.get("mlp_only_layers") or []) and num_experts(config) > 0
            and (layer_idx + 1) % raw.get("decoder_sparse_step", 1) == 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @staticmethod
    def build_mlp(config: HFModelConfig, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        if not qwen3_moe_is_sparse(config, layer_idx):
            return LlamaMLP(config, tp)
        raw = config.raw
        return FusedMoE(num_experts(config), raw["num_experts_per_tok"], config.hidden_size,
                        raw["moe_intermediate_size"], renormalize=bool(raw.get("norm_topk_prob", False)), tp=tp)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return _expert_name(name, "mlp")


class SharedExpertMoE(FusedMoE):
    """Routed experts plus one shared expert that every token takes, scaled per token by
    sigmoid(shared_expert_gate(x)) (Qwen2-MoE's sparse block; the names are its checkpoint's)."""

    def __init__(self, config: HFModelConfig, tp: TensorParallelGroup) -> None:
        raw = config.raw
        super().__init__(num_experts(config), raw["num_experts_per_tok"], config.hidden_size,
                         raw["moe_intermediate_size"], renormalize=bool(raw.get("norm_topk_prob", False)), tp=tp)
        self.shared_expert = LlamaMLP(config, tp, intermediate_size=raw["shared_expert_intermediate_size"])
        self.shared_expert_gate = RouterLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    o_proj_bias = False  # (q / k / v have biases, as Qwen2's)

    @staticmethod
    def build_mlp(config: HFModelConfig, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return SharedExpertMoE(config, tp) if qwen3_moe_is_sparse(config, layer_idx) else LlamaMLP(config, tp)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any] | None:
        return _expert_name(name, "mlp")
