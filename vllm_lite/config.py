"""Engine configuration: `EngineArgs` (what users pass) -> `VllmConfig` (frozen, validated).

This module never imports torch at module level: `vllm_lite.core` imports it and must stay
torch-free.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_lite.config_fields import (CHECKPOINT_QUANTIZATIONS, check_config_fields, check_fallback_fields,
                                     check_quantization_config, fallback_cache_shape, gemma_layer_types,
                                     implementing_architecture, resolve_model_impl, rope_type_of, with_defaults,
                                     with_transformers_names)
from vllm_lite.eagle_config import (EAGLE_METHODS, EAGLE_TARGET_ARCHITECTURES, EagleHeadConfig, eagle_method_of,
                                    read_eagle_head)
from vllm_lite.hub import looks_like_repo_id, resolve_model_path
from vllm_lite.medusa_config import MedusaHeadConfig, read_medusa_head
from vllm_lite.multimodal_checkpoints import is_multimodal, language_model_config
from vllm_lite.vision_config import ImageEncoderConfig, check_processor_kwargs, images_per_prompt, read_image_encoder
from vllm_lite.profiler_config import ProfilerConfig, profiler_config
from vllm_lite.logits_processor import load_logits_processors, processor_name
from vllm_lite.reasoning_tags import REASONING_PARSERS
from vllm_lite.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other `dtype` spellings
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEVICE_NAMES = ("auto", "cpu", "cuda")
# auto: triton on CUDA; on CPU the csrc native ops when built, else torch (the reference).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu_native")
_HF_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32"}
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# vLLM's default share of a GPU's memory for one engine (weights, activations and the KV cache).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
# vLLM CPU's legacy KV cache size in GiB (an environment variable; kv_cache_memory_bytes's twin).
CPU_KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# int8: dynamic W8A8 (int8 weights per output channel, int8 activations per token), CPU only.
# gguf: a .gguf model's Q4_1 / Q8_0 tensors kept in their blocks (implied by a llama .gguf on CPU).
# The checkpoint's own (config_fields.CHECKPOINT_QUANTIZATIONS): implied by its quantization_config.
QUANTIZATION_METHODS = ("int8", "gguf", *CHECKPOINT_QUANTIZATIONS)
# vLLM's names for its faster kernels of a checkpoint's method: the same weights here
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
# ("bitsandbytes": vLLM's older spelling for a bitsandbytes checkpoint's safetensors folder)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "bitsandbytes")
# fcfs: requests in arrival order; priority: by (priority, arrival), the lowest preempted first.
SCHEDULING_POLICIES = ("fcfs", "priority")


def check_priority(priority: int, policy: str) -> None:
    """A request's priority means something only under the priority policy (vLLM's rule)."""
    _check(priority == 0 or policy == "priority",
           f"priority={priority} needs the priority scheduling policy (--scheduling-policy priority); under fcfs "
           "every request's priority is 0")

ENGINE_ARG_ALIASES = {"num_gpu_blocks_override": "num_kv_blocks", "device_memory_utilization": "gpu_memory_utilization"}
# vLLM's: what sampled logprobs are (the sampler's docstring); prompt logprobs are always raw.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's --runner: "generate" samples tokens; "pooling" returns one vector per prompt (an embedding
# model). "auto": pooling for a `*Model` architecture (a checkpoint without a language-model head),
# else generate. vLLM's --convert turns a *ForCausalLM into an embedding model ("embed"); its other
# conversions (classify, reward, ...) are not implemented.
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's sequence pooling types: the last token's hidden state, the mean over the prompt, the first's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# The KV cache's dtype (vLLM's `kv_cache_dtype`): "auto" = the model's dtype; "bfloat16" stores K/V
# in bf16 under a float32 model on CPU (half the cache's bytes and memory traffic; attention still
# computes in fp32). "int8_per_token_head" (vLLM's name and rule) stores each (token, KV head) row
# as int8 codes with one fp32 scale (abs-max / 127, rounded half away from zero), on CPU under any
# model dtype: a quarter of fp32's bytes, a half of bf16's. vLLM's "fp8" (= "fp8_e4m3") and
# "fp8_e5m2" store each K/V element as that float8 with scale 1.0 (vLLM's without calibrated
# scales), saturated at the format's largest value, on CPU under any model dtype (cpu_native or
# torch attention; the csrc decode reads the bytes with a float32 query).
KV_INT8_PER_TOKEN_HEAD = "int8_per_token_head"
KV_FP8_STORAGE = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # torch's names
KV_CACHE_DTYPES = ("auto", "bfloat16", KV_INT8_PER_TOKEN_HEAD, *KV_FP8_STORAGE)
KV_SCALE_BYTES = 4  # an int8 row's fp32 scale, stored in the 4 bytes after its codes


def stored_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype K and V are stored in: the model's for "auto"."""
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


KV_ELEMENT_SIZES = {**DTYPE_SIZES, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def kv_cache_row(stored_dtype: str, head_dim: int) -> tuple[str, int]:
    """(element dtype, elements) of one (token, KV head) row of K or V in the cache tensor: an
    int8_per_token_head row is its int8 codes, then its fp32 scale's bytes; an fp8 row its float8
    elements."""
    if stored_dtype == KV_INT8_PER_TOKEN_HEAD:
        return "int8", head_dim + KV_SCALE_BYTES
    return KV_FP8_STORAGE.get(stored_dtype, stored_dtype), head_dim

# worker in the engine-core process | one process per rank | vLLM's external_launcher: every process of a
# torchrun job runs the engine in process for its rank
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")
# auto: our implementation when there is one, else transformers' modelling code on our KV cache
MODEL_IMPLS = ("auto", "vllm", "transformers")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class LinearAttentionShape:
    """A hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet): in place of keys and
    values they keep, per request, the last `conv_kernel - 1` inputs of a causal convolution over
    `conv_dim` channels and a float32 state of `num_value_heads` x `key_head_dim` x `value_head_dim`."""

    layers: tuple[int, ...]
    conv_dim: int
    conv_kernel: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    def state_bytes(self, conv_element_size: int) -> int:
        """One request's state over every linear-attention layer."""
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_element_size
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return len(self.layers) * (conv + recurrent)

    @staticmethod
    def read(cfg: dict[str, Any]) -> LinearAttentionShape | None:
        """From transformers' `layer_types` ("linear_attention") and the Gated DeltaNet's `linear_*`
        fields; None for a model without such layers (a Mamba hybrid's "linear_attention" layers
        have none of those fields: the fallback refuses them by name)."""
        layers = tuple(i for i, kind in enumerate(cfg.get("layer_types") or ()) if kind == "linear_attention")
        names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
        if not layers or not any(name in cfg for name in names):
            return None
        missing = [name for name in names if not isinstance(cfg.get(name), int) or cfg[name] < 1]
        _check(not missing, f"config.json: layer_types names linear_attention layers, but {', '.join(missing)} "
                            "is missing or not a positive integer")
        key_heads, value_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        _check(value_heads % key_heads == 0, f"config.json: linear_num_value_heads={value_heads} is not a multiple "
                                             f"of linear_num_key_heads={key_heads}")
        key_dim, value_dim = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        return LinearAttentionShape(layers, 2 * key_heads * key_dim + value_heads * value_dim,
                                    cfg["linear_conv_kernel_dim"], value_heads, key_dim, value_dim)


@dataclass(frozen=True, slots=True)
class HFModelConfig:
    """The subset of a Hugging Face `config.json` the model code needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    mlp_bias: bool = False
    # the share of each head's dimensions that rotary turns (GPT-NeoX's rotary_pct); the rest pass
    partial_rotary_factor: float = 1.0
    # per layer: keys a query sees (itself included), None = every earlier key
    sliding_windows: tuple[int | None, ...] = ()
    # the whole config.json, for family-specific fields (vllm_lite/config_fields.py lists them)
    raw: dict[str, Any] = field(default_factory=dict)
    model_impl: str = "vllm"  # resolved: "vllm" (native) or "transformers" (the fallback)
    # config.json's architecture as written: a `*Model` (an embedding model's decoder without its
    # LM head) runs on the `*ForCausalLM` implementation named by `architecture`
    checkpoint_architecture: str = ""
    # the checkpoint's own quantization (config.json quantization_config, checked by config_fields)
    quantization: str | None = None
    # layers that keep a per-request recurrent state in place of keys and values (fallback only)
    linear_attention: LinearAttentionShape | None = None

    @staticmethod
    def from_dict(cfg: dict[str, Any], generation_cfg: dict[str, Any], model_impl: str = "auto") -> HFModelConfig:
        archs = cfg.get("architectures") or []
        _check(len(archs) > 0, "config.json: 'architectures' is missing or empty")
        checkpoint_architecture = archs[0]
        if is_multimodal(checkpoint_architecture):  # served as its language model
            cfg = language_model_config(cfg)
            archs = cfg["architectures"]
        archs = [implementing_architecture(archs[0])]
        model_impl = resolve_model_impl(model_impl, archs[0])
        if model_impl == "vllm":
            check_config_fields(archs[0], cfg)
            cfg = with_defaults(archs[0], cfg)
        else:
            check_fallback_fields(archs[0], cfg)
            cfg = with_transformers_names(cfg)
        raw = dict(cfg)  # (as transformers reads it: a multimodal checkpoint's text model is built from it)
        if model_impl != "vllm":
            cfg.update(fallback_cache_shape(cfg))
        missing = [name for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if not isinstance(cfg.get(name), int)]
        _check(not missing, f"config.json: {', '.join(missing)} missing or not an integer (for {archs[0]})")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = _read_rope(cfg)
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return HFModelConfig(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or cfg.get("ffn_dim") or 0,  # ffn_dim: OPT
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_read_attention_bias(archs[0], cfg),
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=_HF_DTYPE_ALIASES.get(str(dtype), str(dtype)),
            eos_token_ids=_merge_ids(generation_cfg.get("eos_token_id"), cfg.get("eos_token_id")),
            bos_token_id=generation_cfg.get("bos_token_id", cfg.get("bos_token_id")),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and archs[0] in _ARCHITECTURES_WITH_MLP_BIAS,
            partial_rotary_factor=_read_partial_rotary_factor(cfg, _DEFAULT_PARTIAL_ROTARY.get(archs[0], 1.0),
                                                              cfg.get("head_dim") or hidden // num_heads),
            # the fallback's windows reach our attention from transformers' own modules
            sliding_windows=_read_sliding_windows(archs[0], cfg) if model_impl == "vllm" else (),
            raw=raw,
            model_impl=model_impl,
            checkpoint_architecture=checkpoint_architecture,
            quantization=(check_quantization_config(cfg["quantization_config"])
                          if cfg.get("quantization_config") is not None else None),
            linear_attention=LinearAttentionShape.read(cfg) if model_impl != "vllm" else None,
        )

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that rotary turns (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """The layers that keep a recurrent state in place of keys and values (none but a hybrid's)."""
        return self.linear_attention.layers if self.linear_attention is not None else ()

    @property
    def num_kv_cache_layers(self) -> int:
        """The layers that keep keys and values (a hybrid model's linear-attention layers do not)."""
        return self.num_hidden_layers - len(self.linear_attention_layers)

    @property
    def has_sliding_window(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    @property
    def inputs_embeds_size(self) -> int:
        """The width of the model's input embeddings (a prompt_embeds row): OPT's word_embed_proj_dim
        where it projects them in, hidden_size otherwise."""
        return int(self.raw.get("word_embed_proj_dim") or self.hidden_size)

    @property
    def all_layers_window(self) -> int | None:
        """The widest window when every layer slides, else None."""
        if not self.sliding_windows or None in self.sliding_windows:
            return None
        return max(self.sliding_windows)


_ARCHITECTURES_WITH_MLP_BIAS = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")


def _read_attention_bias(architecture: str, cfg: dict[str, Any]) -> bool:
    """As transformers builds each family: Qwen2 always has q/k/v biases, Mistral never has
    any; Llama and Qwen3 follow `attention_bias`."""
    if architecture == "Qwen2ForCausalLM":
        return True
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return False
    if architecture == "Starcoder2ForCausalLM":  # every projection follows `use_bias`
        return bool(cfg.get("use_bias", True))
    if architecture == "GPTNeoXForCausalLM":
        return bool(cfg.get("attention_bias", True))
    if architecture in ("GPT2LMHeadModel", "GPTBigCodeForCausalLM", "PhiForCausalLM", "BloomForCausalLM"):
        return True
    if architecture == "Qwen2MoeForCausalLM":  # q / k / v per qkv_bias (o_proj has none)
        return bool(cfg.get("qkv_bias", True))
    if architecture == "FalconForCausalLM":  # every projection follows `bias`
        return bool(cfg.get("bias", False))
    if architecture == "StableLmForCausalLM":  # q / k / v only (o_proj has none)
        return bool(cfg.get("use_qkv_bias", False))
    return bool(cfg.get("attention_bias", False))


def _read_sliding_windows(architecture: str, cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Per-layer window, as transformers reads it: Mistral's and Mixtral's `sliding_window`
    covers every layer; Gemma's the layers `layer_types` marks sliding; Qwen2/Qwen3 use it only
    with `use_sliding_window`, on the layers `layer_types` marks sliding (by default those from
    `max_window_layers` on), Qwen3-MoE then on every layer."""
    num_layers = cfg["num_hidden_layers"]
    if architecture == "Qwen2MoeForCausalLM":  # (use_sliding_window is refused; its configs say sliding_window 0)
        return (None,) * num_layers
    window = cfg.get("sliding_window")
    _check(window is None or (isinstance(window, int) and window >= 1),
           f"config.json: sliding_window must be an integer >= 1 or null, got {window!r}")
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM"):
        return (window,) * num_layers
    if architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return tuple(window if kind == "sliding_attention" else None
                     for kind in gemma_layer_types(cfg, architecture))
    if not cfg.get("use_sliding_window", False) or window is None:
        return (None,) * num_layers
    if architecture == "Qwen3MoeForCausalLM":
        return (window,) * num_layers
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)]
    _check(len(layer_types) == num_layers,
           f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _read_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Both rope forms: top-level `rope_theta` + `rope_scaling`, and transformers-5
    `rope_parameters` (which holds rope_theta and the scaling type together)."""
    theta, scaling = _read_rope_dict(cfg)
    return theta, complete_rope_scaling(scaling, cfg)


def complete_rope_scaling(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' defaults for the scaling types that extend a pretrained context (llama3,
    yarn, longrope): that context is a top-level `original_max_position_embeddings` where the
    config has one (Phi-3 keeps it there, and it wins), else the dict's own, else
    `max_position_embeddings`; the latter also travels along, since a yarn / longrope dict
    without `factor` takes their ratio."""
    if scaling is None or scaling["rope_type"] not in ("llama3", "yarn", "longrope", "su"):
        return scaling
    max_positions = cfg.get("max_position_embeddings", 2048)
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = scaling.get("original_max_position_embeddings") or max_positions
    return dict(scaling, original_max_position_embeddings=original, max_position_embeddings=max_positions)


# transformers' share of each head that rotary turns when a config gives none (else all of it)
_DEFAULT_PARTIAL_ROTARY = {"GPTNeoXForCausalLM": 0.25, "PhiForCausalLM": 0.5, "StableLmForCausalLM": 0.25}


def _read_partial_rotary_factor(cfg: dict[str, Any], default: float, head_dim: int) -> float:
    """The rope dict's partial_rotary_factor (transformers 5), else the top-level one, else
    GPT-NeoX's older `rotary_pct`; it must turn an even number of each head's dimensions."""
    rope = _rope_source(cfg)
    given = {name: cfg[name] for name in ("partial_rotary_factor", "rotary_pct") if name in cfg}
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        given = {"rope partial_rotary_factor": rope["partial_rotary_factor"], **given}
    factor = _one_value(given, default)
    _check(isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1,
           f"config.json: the partial rotary factor must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    _check(factor == 1 or (rotary_dim >= 2 and rotary_dim % 2 == 0),
           f"config.json: a partial rotary factor of {factor} turns {rotary_dim} of head_dim={head_dim} "
           "dimensions; it must be an even number >= 2")
    return float(factor)


def _one_value(given: dict[str, Any], default: Any) -> Any:
    """The value the config's names for one setting give (the first when they agree); where
    they disagree transformers takes one silently, here it is refused naming both."""
    values = list(given.items())
    for name, value in values[1:]:
        _check(value == values[0][1], f"config.json: {values[0][0]}={values[0][1]!r} and {name}={value!r} "
                                      "disagree; give one")
    return values[0][1] if values else default


def _read_rope_dict(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    rope = _rope_source(cfg)
    # (rotary_emb_base: GPT-NeoX's older name)
    theta = _one_value({name: cfg[name] for name in ("rope_theta", "rotary_emb_base") if name in cfg}, 10000.0)
    if not isinstance(rope, dict):
        return float(theta), None
    return float(rope.get("rope_theta", theta)), rope_scaling_of(rope)


def rope_scaling_of(rope: dict[str, Any] | None) -> dict[str, Any] | None:
    """A rope dict as the rotary layer reads it: its type under `rope_type`; None for plain rope."""
    kind = "default" if rope is None else rope_type_of(rope)
    return None if kind == "default" else dict(rope, rope_type=kind)


def _rope_source(cfg: dict[str, Any]) -> Any:
    """The rope dict transformers 5 reads: a given `rope_scaling` wins over `rope_parameters`
    (its configs save both, `rope_scaling` null, so an override of either takes effect)."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters")


def _merge_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token_id in [value] if isinstance(value, int) else (value or []):
            if token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


# A multimodal config's sub-configs: an override of one updates it (vLLM's nested update), other
# dict-valued fields (rope_scaling, quantization_config) are replaced whole
SUB_CONFIGS = ("text_config", "vision_config", "audio_config")


def with_hf_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = {**cfg, **overrides}
    for name in SUB_CONFIGS:
        if isinstance(cfg.get(name), dict) and isinstance(overrides.get(name), dict):
            merged[name] = {**cfg[name], **overrides[name]}
    return merged


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# vLLM's tokenizer modes this engine has: both load the Hugging Face (fast) tokenizer. vLLM's "slow",
# "mistral" (mistral_common) and "custom" are refused by name.
TOKENIZER_MODES = ("auto", "hf")

# vLLM's --generation-config: "auto" reads the model folder's generation_config.json, "vllm" none,
# anything else is a folder holding one.
GENERATION_CONFIG_SOURCES = ("auto", "vllm")
# The generation_config.json keys vLLM takes as sampling defaults, with transformers'
# GenerationConfig default of each: a value equal to it is no recommendation (vLLM reads the
# config's diff against those defaults).
_SAMPLING_DEFAULT_KEYS: dict[str, float | int | None] = {
    "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None, "max_new_tokens": None}


def sampling_defaults(generation_cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, float | int]:
    """vLLM's `get_diff_sampling_param`: the model's recommended sampling values (those of
    `_SAMPLING_DEFAULT_KEYS` set to other than transformers' defaults), `overrides` on top;
    `max_new_tokens` is named `max_tokens`. The values are checked as SamplingParams would."""
    unknown = sorted(set(overrides) - set(_SAMPLING_DEFAULT_KEYS))
    _check(not unknown, f"override_generation_config keys must be among {sorted(_SAMPLING_DEFAULT_KEYS)}, "
                        f"got {unknown}")
    picked = {key: value for key, value in generation_cfg.items()
              if key in _SAMPLING_DEFAULT_KEYS and value is not None and value != _SAMPLING_DEFAULT_KEYS[key]}
    picked.update((key, value) for key, value in overrides.items() if value is not None)
    if "max_new_tokens" in picked:
        picked["max_tokens"] = picked.pop("max_new_tokens")
    try:
        SamplingParams(**picked)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generation config sampling defaults {picked}: {exc}") from None
    return picked


def _image_fetch_timeout() -> float:
    """vLLM's VLLM_IMAGE_FETCH_TIMEOUT: seconds an image URL's fetch may take (5 by default)."""
    text = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT", "5")
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    _check(0 < seconds < float("inf"), f"VLLM_IMAGE_FETCH_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return seconds


def _media_redirects_allowed() -> bool:
    """vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS: 1 (its default) follows an image URL's redirects, 0 refuses them."""
    text = os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1")
    _check(text in ("0", "1"), f"VLLM_MEDIA_URL_ALLOW_REDIRECTS must be 0 or 1, got {text!r}")
    return text == "1"


@dataclass(frozen=True)
class MediaAccess:
    """Where an image URL may point (vLLM's allowed_local_media_path and allowed_media_domains):
    file: URLs only under `local_folder` (None: none), http(s) URLs only to `domains` (None: any);
    how a fetch runs (vLLM's VLLM_IMAGE_FETCH_TIMEOUT and VLLM_MEDIA_URL_ALLOW_REDIRECTS)."""

    local_folder: str | None = None
    domains: tuple[str, ...] | None = None
    fetch_timeout_s: float = 5.0
    follow_redirects: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str
    max_model_len: int
    seed: int
    hf: HFModelConfig
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS, resolved by the worker
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    quantization: str | None = None  # one of QUANTIZATION_METHODS: linear layers quantized at load
    gguf_file: str | None = None  # the .gguf file `model` was converted from, if any
    # vLLM's hf_overrides: config.json keys replaced before the model is built (checked like the
    # file's own keys); the Transformers fallback applies them to the config it loads.
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    load_format: str = "auto"  # one of LOAD_FORMATS; "dummy": random weights, no checkpoint read
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES
    # vLLM's skip_tokenizer_init: no tokenizer anywhere; prompts are token ids, outputs token ids
    # (text ""), and what needs text (stop strings, grammars, chat templates) is refused.
    skip_tokenizer_init: bool = False
    # The model creator's sampling defaults (`sampling_defaults`): what a server request (and
    # `LLM.generate` without SamplingParams) leaves unset takes these, as in vLLM.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    pooler: PoolerConfig | None = None  # set: the pooling runner (an embedding model); None: generate
    # vLLM's reasoning_parser (one of reasoning_tags.REASONING_PARSERS): the tags a request's
    # thinking_token_budget counts between. None: no budget can be asked for.
    reasoning_parser: str | None = None
    # vLLM's custom logits processors (vllm_lite.logits_processor), by 'module:Class' name
    logits_processors: tuple[str, ...] = ()
    # vLLM's enable_prompt_embeds: a prompt may be given as the model's input embeddings
    enable_prompt_embeds: bool = False
    # image inputs (vllm_lite/vision_config.py): the vision side the workers build, the most images
    # a prompt may carry (vLLM's limit_mm_per_prompt), and why a prompt may carry none
    image_encoder: ImageEncoderConfig | None = None
    max_images_per_prompt: int = 0
    images_refused: str = ""
    # vLLM's mm_processor_cache_gb in bytes: the client keeps processed images up to this (0: none)
    mm_processor_cache_bytes: int = 0
    # vLLM's mm_processor_kwargs: the image processor's keyword arguments for every request (a
    # request's own are applied over them)
    mm_processor_kwargs: dict[str, Any] | None = None
    # where image URLs may point (vLLM's allowed_local_media_path / allowed_media_domains)
    media_access: MediaAccess = field(default_factory=MediaAccess)

    @property
    def runner(self) -> str:
        return "generate" if self.pooler is None else "pooling"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """A pooling model's pooling (vLLM's PoolerConfig): `pooling_type` over the prompt's final
    hidden states. `task` "embed": the vector, L2-normalized when `normalize` (vLLM's
    use_activation for embeddings); "classify" (a `*ForSequenceClassification` checkpoint): the
    classification head's logits over `labels`, through `activation` (vLLM's rule from the
    config's problem_type and num_labels: softmax, sigmoid or identity) when `normalize`."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool = True
    task: str = "embed"  # "embed" | "classify"
    labels: tuple[str, ...] = ()  # classify: the config's id2label, by index
    activation: str = "softmax"  # classify: "softmax" | "sigmoid" | "identity"
    # classify, vLLM's classifier_from_token: the head is made of these tokens' language-model rows
    # (method "from_2_way_softmax": [no, yes] -> one label, the yes row less the no row; vLLM's
    # "no_post_processing": one label per token); empty: the checkpoint's own `score` head
    classifier_token_ids: tuple[int, ...] = ()
    classifier_method: str | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    # Every layer slides over at most this many keys: older blocks are freed. None when some
    # layer attends to everything (then every block stays needed).
    sliding_window: int | None = None
    cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES (vLLM's name for the field)
    # Set: the KV cache takes what is left of this share of the device's memory once the
    # weights and a full step's activations are in (the workers measure it: `kv_cache_budget`);
    # then kv_cache_memory_bytes is None, and num_kv_blocks too until the engine core settled it.
    gpu_memory_utilization: float | None = None


def default_block_size(device: str, attention_backend: str) -> int:
    """vLLM's default KV block size for where the model runs: 128 tokens on CPU (its CPU
    platform's default: a decode step's block bookkeeping and the attention's block reads are 8x
    fewer than at 16), 16 on CUDA and for the Triton kernels (tuned for it)."""
    return 128 if device == "cpu" and attention_backend != "triton" else 16


def max_blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """Block-table width of one sequence: room for `max_model_len + 1` tokens (the last step
    writes the KV of the token it samples at position max_model_len)."""
    return -(-(max_model_len + 1) // block_size)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # Schedule step N+1 while step N runs (vLLM's async scheduling): the tokens step N samples
    # are placeholders to the scheduler until its output arrives (core/scheduler.py).
    async_scheduling: bool = False
    # A streamed request's output every this many new tokens (vLLM's --stream-interval; the
    # client's OutputProcessor applies it): fewer outputs, chunks and socket writes per token.
    stream_interval: int = 1
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES (vLLM's --scheduling-policy)
    # vLLM's: a request's prompt chunk per step is at most this many tokens while other requests
    # wait or run (a long prefill does not starve them); 0: no cap
    long_prefill_token_threshold: int = 0
    # vLLM's admission limits (AsyncLLM, the server: a request past them is refused with 503):
    # unfinished requests (n > 1 counting n), prompt tokens of requests not past their prefill
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # vLLM's: at most this many requests run at once (max_num_seqs still sizes the batch); None:
    # max_num_seqs
    max_num_active: int | None = None
    # vLLM's: a prompt chunk never ends inside an image's placeholder tokens (always, where an
    # image's tokens attend each other both ways: Gemma 3)
    disable_chunked_mm_input: bool = False

    @property
    def max_num_active_seqs(self) -> int:
        return self.max_num_seqs if self.max_num_active is None else self.max_num_active

@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's speculative decoding, its n-gram (prompt lookup) method: each decode step a request
    proposes up to `num_speculative_tokens` draft tokens, the ones that followed the latest
    n-gram of its tokens (the longest of prompt_lookup_min..prompt_lookup_max tokens) where it
    occurred before; the step computes them with its token and keeps those the model itself
    samples (core/ngram_proposer.py, worker/model_runner.py)."""

    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # vLLM's: no drafts while more than this many requests run (None: always drafts)
    disable_by_batch_size: int | None = None
    # or "draft_model": a smaller model of the same vocabulary drafts greedily; "eagle" / "eagle3":
    # an EAGLE head drafts from the model's hidden states (eagle_config.py, worker/eagle.py);
    # "medusa": a Medusa head's k LM heads draft from the model's last hidden state (worker/medusa.py)
    method: str = "ngram"
    draft_model: str | None = None  # the draft model's or head's folder (as `model` was given)
    # the draft's, built with the engine's dtype and length (an EAGLE head's: its Llama layers' config)
    draft_model_config: ModelConfig | None = None
    draft_tensor_parallel_size: int | None = None  # vLLM's; the model's only (the draft runs on its ranks)
    eagle: EagleHeadConfig | None = None  # an EAGLE head's own settings
    medusa: MedusaHeadConfig | None = None  # a Medusa head's (no KV cache: draft_model_config stays None)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def drafts_on_workers(self) -> bool:
        """Whether the workers make the drafts (a draft model, an EAGLE or a Medusa head; the
        scheduler gives each drafting request k places), not the scheduler (n-gram)."""
        return self.method != "ngram"


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism over `nnodes` hosts, `tensor_parallel_size // nnodes` ranks on each.
    Node 0 runs the engine core and ranks 0..ranks_per_node-1; node k runs the next ranks
    (`vllm-lite worker`). The torch.distributed rendezvous (a TCPStore) is hosted by the engine
    core at master_addr:master_port; master_port None picks a free port at start (one node)."""

    tensor_parallel_size: int
    distributed_executor_backend: str = "uni"  # one of EXECUTOR_BACKENDS
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # vLLM's: a class ('module.Class') whose methods every worker gains, for collective_rpc
    worker_extension_cls: str = ""
    # vLLM's data parallelism: this many engine cores, each with its own tensor-parallel ranks
    # (engine/dp_client.py); `data_parallel_rank` is this engine core's
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def model_processes_per_node(self) -> int:
        """The processes that run the model on this node, every data-parallel engine's ranks."""
        return self.ranks_per_node * self.data_parallel_size

    @property
    def first_local_process(self) -> int:
        """This engine's first rank among them (its CPU list, its first GPU)."""
        return self.data_parallel_rank * self.ranks_per_node


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str  # resolved: "cpu" or "cuda"


# vLLM's allowed max_lora_rank values (its MaxLoRARanks)
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """vLLM's LoRA settings (`enable_lora` makes one): at most `max_loras` adapters in one step's
    batch, each of rank <= `max_lora_rank`; every worker keeps at most `max_cpu_loras` loaded.
    `target_modules`: the layers adapters may change, by our (vLLM's) layer names' last part
    (e.g. ["qkv_proj", "o_proj"]); an adapter's other modules are left out. None: every linear
    layer."""

    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int = 1
    target_modules: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    lora_config: LoRAConfig | None = None  # set: the engine serves LoRA adapters (enable_lora)
    speculative_config: SpeculativeConfig | None = None  # set: n-gram speculative decoding
    profiler_config: ProfilerConfig = ProfilerConfig()  # what start_profile records (profiler_config.py)

    @property
    def kv_cache_dtype(self) -> str:
        """The dtype K and V are stored in: the model's unless `kv_cache_dtype` says otherwise."""
        return stored_kv_cache_dtype(self.cache_config.cache_dtype, self.model_config.dtype)

    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes on one rank across all layers (K and V): the model's, and a
        draft model's beside it (its own KV cache, the same blocks). A rank holds its share of the
        KV heads, or one replicated head when there are fewer heads than ranks."""
        spec = self.speculative_config
        draft = spec.draft_model_config if spec is not None else None
        return sum(self._model_block_bytes(config.hf) for config in (self.model_config, draft) if config is not None)

    def _model_block_bytes(self, hf: HFModelConfig) -> int:
        kv_heads = max(1, hf.num_key_value_heads // self.parallel_config.tensor_parallel_size)
        element, row_size = kv_cache_row(self.kv_cache_dtype, hf.head_dim)
        per_layer = 2 * self.cache_config.block_size * kv_heads * row_size * KV_ELEMENT_SIZES[element]
        return per_layer * hf.num_kv_cache_layers

    def state_bytes_per_seq(self) -> int:
        """One request's linear-attention state (a hybrid model's; 0 for other models)."""
        shape = self.model_config.hf.linear_attention
        return shape.state_bytes(KV_ELEMENT_SIZES[self.model_config.dtype]) if shape is not None else 0

    def num_state_slots(self, measured_budget: int | None = None) -> int:
        """How many requests hold a linear-attention state at once (0 for a model without such
        layers): max_num_seqs, or as many as half of the KV cache's memory holds where that is
        fewer (the engine then runs no more requests at once: vLLM's concurrency is bounded by the
        states its cache holds too); max_num_seqs beside a fixed num_kv_blocks. `measured_budget`:
        as for `num_kv_blocks`."""
        each = self.state_bytes_per_seq()
        max_num_seqs = self.scheduler_config.max_num_seqs
        if not each or self.cache_config.num_kv_blocks is not None:
            return max_num_seqs if each else 0
        budget, source = self._kv_cache_budget(measured_budget)
        _check(budget // 2 >= each, f"{source}: one request's linear-attention state takes {each} bytes, more "
                                    "than half of the KV cache's memory; give the KV cache more memory")
        return min(max_num_seqs, budget // 2 // each)

    def _kv_cache_budget(self, measured_budget: int | None) -> tuple[int, str]:
        """The bytes the KV cache (and any linear-attention states) may take, and what said so."""
        cache = self.cache_config
        if cache.gpu_memory_utilization is None:
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            return budget, f"kv_cache_memory_bytes={budget}"
        if measured_budget is None:
            raise ValueError("gpu_memory_utilization: the KV cache budget is measured by the workers; "
                             "pass it (executor.determine_available_memory)")
        return measured_budget, (f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves {measured_budget} "
                                 "bytes for the KV cache")

    def num_kv_blocks(self, measured_budget: int | None = None) -> int:
        """The KV cache size in blocks: the override, else what the memory budget holds (less the
        linear-attention states of `num_state_slots` requests), capped at what the requests that
        run at once could ever use with full-length sequences (more would be dead memory) plus
        the block the pool reserves (block 0 holds no request's tokens: `BlockPool`). With
        gpu_memory_utilization the budget is `measured_budget`, what the workers found free."""
        cache = self.cache_config
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget, source = self._kv_cache_budget(measured_budget)
        sched = self.scheduler_config
        slots = self.num_state_slots(measured_budget)
        budget -= slots * self.state_bytes_per_seq()
        useful = (slots or sched.max_num_seqs) * math.ceil(sched.max_model_len / cache.block_size) + 1
        blocks = min(budget // self.kv_block_bytes(), useful)
        _check(blocks >= 2, f"{source}, which holds {blocks} KV block(s); the engine needs at least "
                            f"2, one of them reserved (one block takes {self.kv_block_bytes()} bytes)")
        return int(blocks)

    def with_num_kv_blocks(self, num_blocks: int) -> VllmConfig:
        """This config with the KV cache size the engine core settled on (a client's copy, once
        the engine core measured its budget; the other fields stay, as what was asked for)."""
        return dataclasses.replace(self, cache_config=dataclasses.replace(self.cache_config, num_kv_blocks=num_blocks))


@dataclass(slots=True)
class EngineArgs:
    """User-facing engine knobs, with vLLM's names and meaning."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None  # vLLM's platform default: 128 on CPU, 16 on CUDA (see default_block_size)
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's share of the device's memory for this engine. None: vLLM's 0.92 on CUDA; on CPU the
    # KV cache takes kv_cache_memory_bytes, else VLLM_CPU_KVCACHE_SPACE GiB, else 2 GiB (vLLM CPU
    # would take 92% of the host's memory: not what a laptop wants).
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # None: on, except for an embedding model pooling other than the last token (the hidden states
    # of cached prompt tokens are never computed).
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool = True
    # Schedule the next step while one runs. None: vLLM's default, on where it pays (CUDA: the
    # host work overlaps the device's) and off on CPU, where the forward pass takes every core
    # and the overlapped scheduling only competes with it (vLLM's CPU platform turns it off too).
    async_scheduling: bool | None = None
    seed: int = 0
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "mp" when tensor_parallel_size > 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one node only)
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    model_impl: str = "auto"  # one of MODEL_IMPLS
    revision: str | None = None  # hub branch, tag or commit when `model` is a hub id
    tokenizer_revision: str | None = None  # the tokenizer's hub revision (None: `revision`, as vLLM)
    hf_token: str | bool | None = None  # hub token (True: the saved login; None: huggingface_hub's default)
    download_dir: str | None = None  # hub cache folder (default: huggingface_hub's)
    quantization: str | None = None  # one of QUANTIZATION_METHODS
    skip_tokenizer_init: bool = False  # token ids in, token ids out: no tokenizer is loaded
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    stream_interval: int = 1  # streamed outputs every this many tokens (first and last at once)
    generation_config: str = "auto"  # one of GENERATION_CONFIG_SOURCES, or a folder
    # vLLM's permission to run a model repository's own code. Taken (scripts written for vLLM pass
    # it) but never used: a natively supported model runs as without it (as in vLLM), and a model
    # that exists only as custom code is refused either way, saying so.
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"  # one of TOKENIZER_MODES
    override_generation_config: dict[str, Any] | None = None  # sampling defaults over the model's
    hf_overrides: dict[str, Any] | None = None  # config.json keys replaced (vLLM's dict form)
    # vLLM's other names of two fields (ENGINE_ARG_ALIASES), folded into ours.
    num_gpu_blocks_override: int | None = None
    device_memory_utilization: float | None = None
    load_format: str = "auto"  # one of LOAD_FORMATS
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES (vLLM's)
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES (vLLM's)
    runner: str = "auto"  # one of RUNNERS (vLLM's)
    convert: str = "auto"  # one of CONVERTS (vLLM's)
    # vLLM's --pooler-config for the pooling runner: pooling_type (or seq_pooling_type) and
    # use_activation (normalize); unset, a sentence-transformers modules.json's, else LAST + normalize.
    pooler_config: dict[str, Any] | None = None
    # vLLM's: whether the stats are off (the periodic stats line, LLM.get_metrics()). Unset: the
    # caller's default, as vLLM's (LLM: off; AsyncLLM: on, its line written by do_log_stats();
    # `vllm-lite serve`: on, --disable-log-stats turns the line off, /metrics counts either way).
    disable_log_stats: bool | None = None
    # vLLM's reasoning_parser (`--reasoning-parser`): what thinking_token_budget needs (its tags)
    reasoning_parser: str | None = None
    # vLLM's LoRA settings (LoRAConfig): requests may name an adapter (LoRARequest) when enable_lora.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # vLLM's: "auto" (the model's dtype) or the model's dtype's name; adapters run in the model's dtype
    lora_dtype: str | None = "auto"
    # vLLM's: how the LoRA matmuls are split across ranks; either way the result is the same sum
    # (here lora_A of a row-parallel layer and lora_B of a column-parallel one are split)
    fully_sharded_loras: bool = False
    lora_target_modules: list[str] | None = None
    # vLLM's custom logits processors: LogitsProcessor subclasses or their 'module:Class' names
    logits_processors: list[Any] | None = None
    # vLLM's speculative decoding (--speculative-config): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}
    speculative_config: dict[str, Any] | None = None
    # vLLM's multimodal limits: a checkpoint whose image inputs are implemented (vision_config.py)
    # takes images unless these say otherwise; any other multimodal checkpoint is served as its
    # language model, and these take only "no such inputs" for it (language_model_only, or 0)
    language_model_only: bool = False
    limit_mm_per_prompt: dict[str, Any] | None = None
    # vLLM's: GiB of processed images (pixel values) the client keeps by image content, so an image
    # seen again skips the image processor (0: none kept)
    mm_processor_cache_gb: float = 4.0
    # vLLM's: keyword arguments of the model's image processor for every request (e.g. Qwen2-VL's
    # {"max_pixels": 1003520}); a request's own mm_processor_kwargs are applied over them
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: file: image URLs are read only under this folder ("": none are); http(s) image URLs
    # only from these hosts (None: any host)
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    # vLLM's --profiler-config: {"profiler": "torch", "torch_profiler_dir": ...} lets
    # start_profile / stop_profile record torch profiler traces (profiler_config.py)
    profiler_config: dict[str, Any] | None = None
    # vLLM's: while other requests wait or run, a request's prompt chunk per step is at most this
    # many tokens (0: no cap)
    long_prefill_token_threshold: int = 0
    # vLLM's: the server (AsyncLLM) refuses a request with 503 past this many unfinished requests,
    # or past this many prompt tokens of requests not past their prefill
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # vLLM's: at most this many requests run at once (smaller decode batches), max_num_seqs still
    # sizing the batch's buffers; None: max_num_seqs
    max_num_active_seqs: int | None = None
    # vLLM's: a prompt chunk never ends inside an image's placeholder tokens (an image is computed
    # in one step); always on for models whose image tokens attend each other both ways (Gemma 3)
    disable_chunked_mm_input: bool = False
    # vLLM's (its default): cascade attention is not implemented here, so only True is taken
    disable_cascade_attn: bool = True
    # vLLM's: max_model_len capped at the model's sliding window (where its sliding layers attend
    # to every earlier token, as full attention does)
    disable_sliding_window: bool = False
    # vLLM's --data-parallel-size (-dp): this many engine cores, each a copy of the model with its
    # own tensor-parallel ranks, requests balanced between them (engine/dp_client.py)
    data_parallel_size: int = 1
    # vLLM's --worker-extension-cls: a class ('module.Class') whose methods every worker gains
    # (called by LLM.collective_rpc by name: an RL trainer's weight-update methods)
    worker_extension_cls: str = ""
    # vLLM's --enable-prompt-embeds: prompts may be given as input embeddings ({"prompt_embeds": tensor},
    # the completions API's base64 `prompt_embeds`) in place of token ids
    enable_prompt_embeds: bool = False
    # vLLM's --enable-sleep-mode, which RL frameworks pass: sleep / wake_up are always available
    # here (levels 0, 1 and 2 on CPU, 0 on CUDA; others refused when asked), so both values are taken
    enable_sleep_mode: bool = False
    # vLLM's --disable-custom-all-reduce: no custom all-reduce kernel exists here (torch.distributed's
    # all-reduce always runs), so both values run the same reduction
    disable_custom_all_reduce: bool = False
    # vLLM's --pipeline-parallel-size (-pp): pipeline parallelism is not implemented, so only 1
    pipeline_parallel_size: int = 1
    # vLLM's --enable-expert-parallel: MoE experts are split by tensor parallelism here, so only False
    enable_expert_parallel: bool = False

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def create_engine_config(self) -> VllmConfig:
        return self._canonical()._engine_config()

    def _auto_max_model_len(self) -> VllmConfig:
        """vLLM's max_model_len "auto" / -1: the model's own length, or the longest a sequence can
        have in the KV cache when that is less (one block is reserved, and the last step writes
        the KV of the token it samples: `max_blocks_per_seq`). The cache's size must be known
        here: not under gpu_memory_utilization, which the workers measure later."""
        config = dataclasses.replace(self, max_model_len=None)._engine_config()
        cache = config.cache_config
        _check(cache.gpu_memory_utilization is None,
               "max_model_len='auto' (-1) needs the KV cache's size before the workers start: give "
               "kv_cache_memory_bytes or num_kv_blocks, or a length, with gpu_memory_utilization")
        if cache.sliding_window is not None:  # every layer slides: blocks outside the window are freed
            return config
        blocks = cache.num_kv_blocks if cache.num_kv_blocks is not None else \
            (cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // config.kv_block_bytes()
        fits = (blocks - 1) * cache.block_size - 1
        if fits >= config.model_config.max_model_len:
            return config
        _check(fits >= 1, f"max_model_len='auto' (-1): the KV cache holds {blocks} block(s) of "
                          f"{cache.block_size} tokens, one reserved: no room for a sequence")
        logger.info("max_model_len='auto': %d, the longest the KV cache holds (the model's is %d)", fits,
                    config.model_config.max_model_len)
        return dataclasses.replace(self, max_model_len=fits)._engine_config()

    def _canonical(self) -> EngineArgs:
        """These arguments with vLLM's other names for a field folded into ours (the same value
        under both names is fine; two different values are refused, naming both)."""
        values = {name: getattr(self, name) for name in self.field_names()}
        for alias, name in ENGINE_ARG_ALIASES.items():
            given = values.pop(alias)
            if given is None:
                continue
            _check(values[name] is None or values[name] == given,
                   f"{alias}={given!r} and {name}={values[name]!r} are one setting (vLLM's two names for it); "
                   "give one")
            values[name] = given
        return EngineArgs(**values)

    def _engine_config(self) -> VllmConfig:
        if self.max_model_len == -1:
            return self._auto_max_model_len()
        _check(self.disable_cascade_attn is True, "disable_cascade_attn=False: cascade attention is not implemented "
                                                  "here (attention over a shared prefix runs per request)")
        _check(self.pipeline_parallel_size == 1, f"pipeline_parallel_size={self.pipeline_parallel_size}: pipeline "
               "parallelism is not implemented here; split the model with tensor_parallel_size")
        _check(self.enable_expert_parallel is False, "enable_expert_parallel=True: expert parallelism is not "
               "implemented here (a MoE layer's experts are split across ranks by tensor parallelism)")
        device = _resolve_device(self.device)
        model_config = self._model_config(device)
        max_len = model_config.max_model_len
        parallel_config = self._parallel_config(model_config.hf)
        if device == "cpu":  # VLLM_CPU_OMP_THREADS_BIND, checked before any process starts
            from vllm_lite.cpu_info import bound_cpu_lists

            bound_cpu_lists(parallel_config.model_processes_per_node)
        config = VllmConfig(
            model_config=model_config,
            cache_config=self._cache_config(model_config, device),
            scheduler_config=self._scheduler_config(max_len, device, model_config.image_encoder),
            parallel_config=parallel_config,
            device_config=DeviceConfig(device=device),
            lora_config=self._lora_config(model_config),
            profiler_config=profiler_config(self.profiler_config, device),
        )
        if config.model_config.logits_processors:
            self._check_logits_processors(config)
            config = dataclasses.replace(config, scheduler_config=self._without_async_scheduling(
                config.scheduler_config, "logits_processors", "a processor sees each step's batch after the last "
                "step's tokens"))
        if self.speculative_config is not None:
            spec = speculative_config(self.speculative_config)
            if spec.uses_draft_model and _is_medusa_head(spec.draft_model, self.download_dir, self.hf_token):
                spec = dataclasses.replace(spec, method="medusa")  # (vLLM's inference, from the head's model_type)
            if spec.uses_draft_model:
                spec = dataclasses.replace(spec, draft_model_config=self._draft_model_config(spec, model_config, device))
            elif spec.method in EAGLE_METHODS:
                spec = self._with_eagle_head(spec, model_config)
            elif spec.method == "medusa":
                spec = self._with_medusa_head(spec, model_config)
            scheduler_config = self._without_async_scheduling(config.scheduler_config, "speculative_config",
                                                              "a step's drafts come from the last step's tokens")
            config = dataclasses.replace(config, speculative_config=spec, scheduler_config=scheduler_config)
            check_speculative_decoding(config)
            _check(model_config.hf.linear_attention is None,
                   f"speculative_config: {model_config.hf.architecture}'s linear-attention layers would take rejected "
                   "draft tokens into their per-request state, which is not rolled back; leave speculative_config unset")
        return config

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig, device: str) -> ModelConfig:
        """The draft model's config: read as the engine's model is, in the engine's dtype and
        length; its vocabulary must be the model's (vLLM's rule: the draft's tokens are the model's)."""
        self._check_draft_ranks(spec)
        draft = dataclasses.replace(
            self, model=spec.draft_model, tokenizer=None, revision=None, tokenizer_revision=None, quantization=None,
            max_model_len=target.max_model_len, dtype=target.dtype, hf_overrides=None, speculative_config=None,
            model_impl="auto", generation_config="vllm", override_generation_config=None, runner="generate",
            convert="auto", pooler_config=None, logits_processors=None)._model_config(device)
        _check(draft.hf.vocab_size == target.hf.vocab_size,
               f"speculative_config: the draft model's vocab_size={draft.hf.vocab_size} is not the model's "
               f"({target.hf.vocab_size}): a draft model must share the model's tokenizer")
        _check(draft.hf.model_impl == "vllm", f"speculative_config: draft model {draft.hf.architecture} runs through "
                                               "transformers' modelling code, which drafts are not implemented for")
        _check(draft.quantization is None, f"speculative_config: a quantized draft model ({draft.quantization}) is "
                                            "not implemented")
        _check(not draft.hf.has_sliding_window, "speculative_config: a draft model with sliding-window layers is not "
                                                 "implemented")
        check_tensor_parallel_split(draft.hf, self.tensor_parallel_size)  # (the draft is split as the model is)
        return draft

    def _with_eagle_head(self, spec: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
        """An EAGLE head's settings and its Llama layers' config (its KV cache sits beside the
        model's, in the same blocks, as a draft model's does)."""
        _check(target.hf.architecture in EAGLE_TARGET_ARCHITECTURES and target.hf.model_impl == "vllm",
               f"speculative_config: method={spec.method!r} drafts for the Llama-family models here "
               f"({', '.join(EAGLE_TARGET_ARCHITECTURES)}), not {target.hf.architecture}"
               f"{' through the Transformers fallback' if target.hf.model_impl != 'vllm' else ''}")
        head_dir = self._head_folder(spec)
        eagle, cfg = read_eagle_head(_read_json(head_dir / "config.json"), spec.method, target.hf.num_hidden_layers,
                                     target.hf.hidden_size, target.hf.vocab_size)
        hf = HFModelConfig.from_dict(cfg, {}, "vllm")
        _check(hf.quantization is None, "speculative_config: a quantized EAGLE head is not implemented")
        _check(not hf.has_sliding_window, "speculative_config: an EAGLE head with sliding-window layers is not "
                                          "implemented")
        check_tensor_parallel_split(hf, self.tensor_parallel_size)  # (the head is split as the model is)
        head = dataclasses.replace(target, model=str(head_dir), hf=hf, quantization=None, gguf_file=None)
        return dataclasses.replace(spec, draft_model_config=head, eagle=eagle)

    def _with_medusa_head(self, spec: SpeculativeConfig, target: ModelConfig) -> SpeculativeConfig:
        """A Medusa head's settings; k defaults to its number of heads (vLLM's) and may not pass it."""
        _check(target.hf.model_impl == "vllm", f"speculative_config: method='medusa' on {target.hf.architecture} "
                                               "through the Transformers fallback is not implemented")
        head_dir = self._head_folder(spec)
        medusa = read_medusa_head(_read_json(head_dir / "config.json"), target.hf.hidden_size, target.hf.vocab_size)
        k = spec.num_speculative_tokens or medusa.num_heads
        _check(k <= medusa.num_heads, f"speculative_config: num_speculative_tokens={k} is more than the Medusa "
                                      f"head's {medusa.num_heads} heads")
        return dataclasses.replace(spec, num_speculative_tokens=k, draft_model=str(head_dir), medusa=medusa)

    def _head_folder(self, spec: SpeculativeConfig) -> Path:
        """An EAGLE or Medusa head's folder (a hub id downloaded), which runs on the model's ranks."""
        self._check_draft_ranks(spec)
        head_dir = resolve_model_path(spec.draft_model, None, self.download_dir, self.hf_token)
        _check(head_dir.is_dir() and (head_dir / "config.json").is_file(),
               f"speculative_config: model '{spec.draft_model}' is no folder with a config.json")
        return head_dir

    def _check_draft_ranks(self, spec: SpeculativeConfig) -> None:
        _check(spec.draft_tensor_parallel_size in (None, self.tensor_parallel_size),
               f"speculative_config: draft_tensor_parallel_size={spec.draft_tensor_parallel_size}: the draft runs on "
               f"the model's {self.tensor_parallel_size} rank(s), split as the model is")

    def _without_async_scheduling(self, scheduler_config: SchedulerConfig, feature: str, why: str) -> SchedulerConfig:
        """Features that need each step's tokens known before the next step is scheduled
        (speculative decoding's drafts, custom logits processors' output lists): their steps run
        in order. Unset async_scheduling then means off (a choice of speed only); asking for it
        is refused."""
        _check(self.async_scheduling is not True, f"{feature} with async_scheduling=True is not implemented here "
               f"({why}); leave async_scheduling unset or pass async_scheduling=False")
        return dataclasses.replace(scheduler_config, async_scheduling=False)

    def _logits_processors(self) -> tuple[str, ...]:
        """vLLM's custom logits processors by name, each imported here once (a name that does not
        import, or a class that is no LogitsProcessor, is refused before any process starts)."""
        names = tuple(processor_name(p) for p in self.logits_processors or ())
        load_logits_processors(names)
        return names

    @staticmethod
    def _check_logits_processors(config: VllmConfig) -> None:
        """Custom logits processors run in the generate runner (their steps in order: the caller
        turns async scheduling off)."""
        _check(config.model_config.pooler is None, "Pooling models do not support custom logits processors.")

    def _lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        """vLLM's LoRA settings, checked as vLLM checks them; None without enable_lora (then every
        LoRA setting must keep its default: one given alone would be ignored)."""
        if not self.enable_lora:
            given = [name for name, default in (("max_cpu_loras", None), ("lora_target_modules", None))
                     if getattr(self, name) != default]
            _check(not given, f"{', '.join(given)} set without enable_lora=True")
            return None
        _check(model_config.hf.model_impl == "vllm",
               f"enable_lora: LoRA adapters run on the native models only ({model_config.hf.architecture} runs "
               "through transformers' modelling code)")
        _check(model_config.hf.architecture != "GPT2LMHeadModel",
               "enable_lora: LoRA adapters of GPT-2 (PEFT's fan_in_fan_out adapters of its Conv1D layers) are "
               "not implemented")
        _check(self.max_lora_rank in MAX_LORA_RANKS,
               f"max_lora_rank must be one of {MAX_LORA_RANKS} (vLLM's), got {self.max_lora_rank!r}")
        _check(isinstance(self.max_loras, int) and self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras!r}")
        cpu_loras = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        _check(cpu_loras >= self.max_loras, f"max_cpu_loras ({cpu_loras}) must be >= max_loras ({self.max_loras})")
        _check(self.lora_dtype in (None, "auto", model_config.dtype),
               f"lora_dtype={self.lora_dtype!r}: adapters run in the model's dtype ({model_config.dtype!r}); "
               "give 'auto' or that")
        targets = self.lora_target_modules
        _check(targets is None or (isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets)),
               f"lora_target_modules must be a list of layer names, got {targets!r}")
        return LoRAConfig(self.max_lora_rank, self.max_loras, cpu_loras, tuple(targets) if targets else None)

    def _model_config(self, device: str) -> ModelConfig:
        model_dir = (resolve_model_path(self.model, self.revision, self.download_dir, self.hf_token) if self.model
                     else _demo_gguf())
        gguf_file = model_dir if model_dir.is_file() and model_dir.suffix == ".gguf" else None
        if gguf_file is not None:
            model_dir = _gguf_model_dir(gguf_file) if self.model else _demo_model_dir()
        _check(model_dir.is_dir(), f"model: '{model_dir}' is not a folder (nor a .gguf file)")
        cfg_path = model_dir / "config.json"
        _check(cfg_path.is_file(), f"model: '{model_dir}' has no config.json")
        _check(self.model_impl in MODEL_IMPLS, f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _check(self.tokenizer_mode in TOKENIZER_MODES,
               f"tokenizer_mode must be one of {TOKENIZER_MODES} (the Hugging Face tokenizer; vLLM's 'slow', "
               f"'mistral' and 'custom' are not implemented), got {self.tokenizer_mode!r}")
        _check(self.hf_overrides is None or isinstance(self.hf_overrides, dict),
               f"hf_overrides must be a dict of config.json keys (vLLM's callable form is not implemented), "
               f"got {type(self.hf_overrides).__name__}")
        hf_overrides = dict(self.hf_overrides or {})
        checkpoint_cfg = with_hf_overrides(_read_json(cfg_path), hf_overrides)
        hf = HFModelConfig.from_dict(checkpoint_cfg, _read_json(model_dir / "generation_config.json"), self.model_impl)
        _check(self.load_format != "bitsandbytes" or hf.quantization == "bitsandbytes",
               "load_format='bitsandbytes' reads a bitsandbytes checkpoint (config.json's quantization_config); "
               "quantizing a float checkpoint with bitsandbytes at load is not implemented (quantization='int8' "
               "quantizes here)")
        load_format = _resolve_load_format("safetensors" if self.load_format == "bitsandbytes" else self.load_format,
                                           gguf_file)
        _check(self.logprobs_mode in LOGPROBS_MODES,
               f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        _check(self.reasoning_parser in (None, *REASONING_PARSERS),
               f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        _check(self.max_logprobs >= -1, f"max_logprobs must be >= 0, or -1 (no limit: the vocabulary size, "
               f"as vLLM), got {self.max_logprobs}")
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        _check(dtype in DTYPE_NAMES, f"dtype must be one of {DTYPE_NAMES} (or vLLM's {', '.join(DTYPE_ALIASES)}), "
                                     f"got {self.dtype!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        quantization = QUANTIZATION_ALIASES.get(self.quantization, self.quantization)
        _check(quantization is None or quantization in QUANTIZATION_METHODS,
               f"quantization must be one of {QUANTIZATION_METHODS} (or vLLM's {', '.join(QUANTIZATION_ALIASES)}) "
               f"or None, got {self.quantization!r}")
        quantization = _resolve_checkpoint_quantization(quantization, hf.quantization)
        _check_quantization_device(quantization, hf, device)
        _check(quantization != "mxfp4" or hf.model_impl == "transformers",
               f"config.json: quantization_config.quant_method='mxfp4' (gpt-oss's experts) loads through the "
               f"Transformers fallback only, which dequantizes them; {hf.architecture} runs natively here")
        if quantization in ("int8", "compressed-tensors") and device == "cpu":
            _warn_int8_without_dot_products()
        if dtype == "float16" and device == "cpu":
            _warn_slow_float16()
        quantization = _resolve_gguf_quantization(quantization, gguf_file, device, self.tensor_parallel_size,
                                                  hf.model_impl)
        tokenizer = self._tokenizer_path(model_dir)
        model_len, source = derived_max_model_len(hf, tokenizer)
        window = smallest_sliding_window(hf)
        if self.disable_sliding_window and window is not None and window < model_len:
            # (within the window a sliding layer attends to every earlier token: full attention)
            model_len, source = window, f"sliding_window={window}, with disable_sliding_window"
        max_len = _default_max_model_len(hf, model_len) if self.max_model_len is None else self.max_model_len
        _check(max_len >= 1, f"max_model_len must be >= 1, got {max_len}")
        if max_len > model_len:
            _allow_long_max_model_len(hf, max_len, model_len, source)
        _check_longrope_length(hf, max_len)
        image_encoder, images_refused = _image_inputs(hf, checkpoint_cfg, self.language_model_only)
        max_images = images_per_prompt(self.limit_mm_per_prompt, self.language_model_only, hf.checkpoint_architecture,
                                       images_refused)
        # (the image processor's arguments: refused where no image can reach it, rather than unused)
        _check(not self.mm_processor_kwargs or max_images > 0,
               f"mm_processor_kwargs={self.mm_processor_kwargs!r} is for a model that takes images; this one takes "
               f"none ({images_refused or 'limit_mm_per_prompt gives 0 images'})")
        return ModelConfig(
            model=str(model_dir),
            tokenizer=tokenizer,
            dtype=_resolve_dtype(dtype, hf.torch_dtype, device),
            max_model_len=max_len,
            seed=self.seed,
            hf=hf,
            max_logprobs=hf.vocab_size if self.max_logprobs == -1 else self.max_logprobs,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            quantization=quantization,
            hf_overrides=hf_overrides,
            load_format=load_format,
            logprobs_mode=self.logprobs_mode,
            gguf_file=str(gguf_file) if gguf_file is not None else None,
            skip_tokenizer_init=self.skip_tokenizer_init,
            reasoning_parser=self.reasoning_parser,
            logits_processors=self._logits_processors(),
            sampling_defaults=sampling_defaults(self._generation_cfg(model_dir), self.override_generation_config or {}),
            pooler=self._pooler(hf, model_dir, tokenizer),
            enable_prompt_embeds=self.enable_prompt_embeds,
            image_encoder=image_encoder if max_images else None,
            max_images_per_prompt=max_images,
            images_refused=images_refused or ("" if max_images else "limit_mm_per_prompt gives 0 images"),
            mm_processor_cache_bytes=self._mm_processor_cache_bytes(),
            mm_processor_kwargs=check_processor_kwargs(self.mm_processor_kwargs, "mm_processor_kwargs"),
            media_access=self._media_access(),
        )

    def _media_access(self) -> MediaAccess:
        folder, domains = self.allowed_local_media_path, self.allowed_media_domains
        _check(isinstance(folder, str), f"allowed_local_media_path must be a folder's path, got {folder!r}")
        if folder:
            _check(Path(folder).is_dir(), f"allowed_local_media_path={folder!r} is not an existing folder")
        _check(domains is None or isinstance(domains, (list, tuple)) and all(isinstance(d, str) and d for d in domains),
               f"allowed_media_domains must be a list of host names, got {domains!r}")
        return MediaAccess(str(Path(folder).resolve()) if folder else None,
                           tuple(domain.lower() for domain in domains) if domains is not None else None,
                           _image_fetch_timeout(), _media_redirects_allowed())

    def _mm_processor_cache_bytes(self) -> int:
        gib = self.mm_processor_cache_gb
        _check(isinstance(gib, (int, float)) and not isinstance(gib, bool) and 0 <= gib < float("inf"),
               f"mm_processor_cache_gb must be a number of GiB >= 0, got {gib!r}")
        return int(gib * 2**30)

    def _pooler(self, hf: HFModelConfig, model_dir: Path, tokenizer: str) -> PoolerConfig | None:
        """The pooling runner's config, or None for the generate runner (vLLM's --runner,
        --convert and --pooler-config)."""
        _check(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        _check(self.convert in CONVERTS, f"convert must be one of {CONVERTS} (vLLM's classify, reward and other "
                                         f"conversions are not implemented), got {self.convert!r}")
        runner = self.runner
        _check(not is_multimodal(hf.checkpoint_architecture) or (runner in ("auto", "generate")
                                                                 and self.convert in ("auto", "none")
                                                                 and self.pooler_config is None),
               f"runner={runner!r}, convert={self.convert!r}, pooler_config: {hf.checkpoint_architecture} (a multimodal "
               "checkpoint, served as its language model) runs with the generate runner only")
        # no LM head: an embedding model (GPT-2's `*LMHeadModel` has one)
        decoder_only = hf.checkpoint_architecture.endswith("Model") and not hf.checkpoint_architecture.endswith(
            "LMHeadModel")
        classifier = hf.checkpoint_architecture.endswith("ForSequenceClassification")
        if runner == "auto":
            runner = "pooling" if decoder_only or classifier or self.convert in ("embed", "classify") else "generate"
        if runner == "generate":
            _check(self.convert not in ("embed", "classify") and self.pooler_config is None,
                   f"convert={self.convert!r} and pooler_config are for the pooling runner (runner='pooling')")
            _check(not (decoder_only or classifier),
                   f"architecture {hf.checkpoint_architecture!r} has no language-model head: it runs with "
                   f"runner='pooling' ({'a classification' if classifier else 'an embedding'} model)")
            return None
        if classifier or self.convert == "classify":
            _check(classifier, f"convert='classify' makes a classifier of a *ForSequenceClassification checkpoint "
                               f"only (vLLM's conversion of {hf.checkpoint_architecture} with a head from its "
                               "language-model head is not implemented)")
            _check(self.convert in ("auto", "classify"), f"convert={self.convert!r}: {hf.checkpoint_architecture} "
                                                         "is a classification model (convert='classify')")
            _check(hf.model_impl == "vllm", "runner='pooling' runs the native implementations only "
                                            f"({hf.architecture} runs through transformers' modelling code)")
            return classifier_pooler_config(self.pooler_config, hf, tokenizer)
        _check(self.convert != "none", f"convert='none' with runner='pooling': {hf.checkpoint_architecture} is no "
                                       "pooling model of its own; convert='embed' (the default) makes it one")
        _check(hf.model_impl == "vllm", "runner='pooling' runs the native implementations only "
                                        f"({hf.architecture} runs through transformers' modelling code)")
        return pooler_config(self.pooler_config, model_dir)

    def _generation_cfg(self, model_dir: Path) -> dict[str, Any]:
        """The generation_config.json whose sampling values are the defaults (--generation-config)."""
        if self.generation_config == "vllm":
            return {}
        folder = model_dir if self.generation_config == "auto" else Path(self.generation_config)
        _check(folder.is_dir(), f"generation_config must be one of {GENERATION_CONFIG_SOURCES} or a folder, "
                                f"got {self.generation_config!r}")
        return _read_json(folder / "generation_config.json")

    def _tokenizer_path(self, model_dir: Path) -> str:
        """`tokenizer` (a folder or hub id), else the model's own files: its folder, or its hub
        repository at tokenizer_revision when that differs. tokenizer_revision defaults to
        `revision` (vLLM's rule: the tokenizer is consistent with the model)."""
        if self.tokenizer:
            revision = self.revision if self.tokenizer_revision is None else self.tokenizer_revision
            return str(resolve_model_path(self.tokenizer, revision, self.download_dir, self.hf_token,
                                          weights=False, field="tokenizer"))
        if self.tokenizer_revision is not None and self.tokenizer_revision != self.revision and self.model:
            _check(looks_like_repo_id(self.model) and not Path(self.model).expanduser().exists(),
                   f"tokenizer_revision={self.tokenizer_revision!r} names a hub revision, but the model "
                   f"'{self.model}' is a local path: give tokenizer= instead")
            return str(resolve_model_path(self.model, self.tokenizer_revision, self.download_dir, self.hf_token,
                                          weights=False, field="tokenizer_revision"))
        return str(model_dir)

    def _cache_config(self, model_config: ModelConfig, device: str) -> CacheConfig:
        bs = self.block_size if self.block_size is not None else default_block_size(device, self.attention_backend)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        cpu_backend = device == "cpu" and self.attention_backend != "triton"
        if self.kv_cache_dtype == KV_INT8_PER_TOKEN_HEAD or self.kv_cache_dtype in KV_FP8_STORAGE:
            _check(cpu_backend, f"kv_cache_dtype={self.kv_cache_dtype!r} runs only on CPU, with the cpu_native or "
                   f"torch attention backend (device {device!r}, attention_backend {self.attention_backend!r})")
        else:
            _check(stored_kv_cache_dtype(self.kv_cache_dtype, model_config.dtype) == model_config.dtype
                   or (cpu_backend and model_config.dtype == "float32"),
                   f"kv_cache_dtype={self.kv_cache_dtype!r} differs from dtype={model_config.dtype!r}: a KV cache "
                   "in another dtype than the model's runs only under a float32 model on CPU, with the cpu_native "
                   f"or torch attention backend (device {device!r}, attention_backend {self.attention_backend!r})")
        _check(bs >= 1 and bs & (bs - 1) == 0, f"block_size must be a power of two >= 1, got {bs}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
               f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")
        kv_bytes = self._kv_cache_memory_bytes(device)
        return CacheConfig(bs, self.num_kv_blocks, kv_bytes, self._prefix_caching(model_config),
                           model_config.hf.all_layers_window, self.kv_cache_dtype,
                           self._gpu_memory_utilization(device, kv_bytes))

    def _prefix_caching(self, model_config: ModelConfig) -> bool:
        """On unless a pooling needs every prompt token's hidden state (MEAN, CLS): a cached
        block's tokens are not computed again; or the model has linear-attention layers, whose
        state after a prefix is not in the cached blocks (vLLM 0.32 keeps a copy of the state at
        each block's end for them, its mamba_cache_mode "align"; not implemented here)."""
        if model_config.hf.linear_attention is not None:
            _check(not self.enable_prefix_caching,
                   f"enable_prefix_caching: {model_config.hf.architecture} has linear-attention layers "
                   f"{list(model_config.hf.linear_attention.layers)}, whose per-request state after a prefix is not "
                   "kept in the cached blocks; leave enable_prefix_caching unset for it")
            return False
        pooler = model_config.pooler
        every_token = pooler is not None and pooler.pooling_type != "LAST"
        _check(not (every_token and self.enable_prefix_caching),
               f"enable_prefix_caching with pooling_type {pooler.pooling_type if pooler else ''!r}: the pooling "
               "reads every prompt token's hidden state, and cached tokens are not computed again")
        return not every_token if self.enable_prefix_caching is None else self.enable_prefix_caching

    def _kv_cache_memory_bytes(self, device: str) -> int | None:
        """kv_cache_memory_bytes, or on CPU vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) when it is not given."""
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        space = os.environ.get(CPU_KV_CACHE_SPACE_ENV, "").strip()
        if device != "cpu" or not space or self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        _check(space.isdigit(), f"{CPU_KV_CACHE_SPACE_ENV} must be a whole number of GiB, got {space!r}")
        return int(space) << 30 or None  # vLLM: 0 means unset

    def _gpu_memory_utilization(self, device: str, kv_cache_memory_bytes: int | None) -> float | None:
        """The share of device memory the KV cache is sized from, or None when a fixed size is given
        (kv_cache_memory_bytes, num_kv_blocks) or, on CPU, when the share is not asked for."""
        utilization = self.gpu_memory_utilization
        if utilization is None:
            fixed = kv_cache_memory_bytes is not None or self.num_kv_blocks is not None
            return None if fixed or device == "cpu" else DEFAULT_GPU_MEMORY_UTILIZATION
        _check(isinstance(utilization, (int, float)) and not isinstance(utilization, bool) and 0 < utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        fixed_sizes = {"kv_cache_memory_bytes": self.kv_cache_memory_bytes, "num_kv_blocks": self.num_kv_blocks}
        if kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes is None:
            fixed_sizes[CPU_KV_CACHE_SPACE_ENV] = os.environ[CPU_KV_CACHE_SPACE_ENV]
        for name, value in fixed_sizes.items():  # vLLM lets a fixed size win without a word
            _check(value is None, f"gpu_memory_utilization={utilization} and {name}={value} both size the KV cache; "
                                  "give one of them")
        return float(utilization)

    def _scheduler_config(self, max_model_len: int, device: str,
                          image_encoder: ImageEncoderConfig | None = None) -> SchedulerConfig:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        default_tokens = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        max_tokens = default_tokens if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        _check(max_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {max_tokens}")
        _check(self.enable_chunked_prefill or max_tokens >= max_model_len,
               f"max_num_batched_tokens={max_tokens} is smaller than max_model_len={max_model_len}; "
               "enable chunked prefill or raise max_num_batched_tokens")
        _check(self.stream_interval >= 1, f"stream_interval must be >= 1, got {self.stream_interval}")
        async_scheduling = self.async_scheduling if self.async_scheduling is not None else device != "cpu"
        _check(self.scheduling_policy in SCHEDULING_POLICIES,
               f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        threshold = self.long_prefill_token_threshold
        _check(isinstance(threshold, int) and 0 <= threshold <= max_model_len,
               f"long_prefill_token_threshold must be in [0, max_model_len={max_model_len}], got {threshold!r}")
        _check(threshold == 0 or self.enable_chunked_prefill,
               "long_prefill_token_threshold cuts prompts into chunks: it needs enable_chunked_prefill")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 0), f"{name} must be >= 0 or None, got {value!r}")
        active = self.max_num_active_seqs
        _check(active is None or (isinstance(active, int) and 1 <= active <= self.max_num_seqs),
               f"max_num_active_seqs must be in [1, max_num_seqs={self.max_num_seqs}] or None, got {active!r}")
        _check(isinstance(self.disable_chunked_mm_input, bool),
               f"disable_chunked_mm_input must be a bool, got {self.disable_chunked_mm_input!r}")
        images_attend_both_ways = image_encoder is not None and image_encoder.bidirectional
        if images_attend_both_ways:
            _check(max_tokens >= image_encoder.tokens_per_image,
                   f"max_num_batched_tokens={max_tokens} is smaller than an image's {image_encoder.tokens_per_image} "
                   "tokens, which this model computes in one step (they attend each other both ways)")
        return SchedulerConfig(self.max_num_seqs, max_tokens, max_model_len, self.enable_chunked_prefill,
                               async_scheduling, self.stream_interval, self.scheduling_policy, threshold,
                               self.max_num_queued_reqs, self.max_num_queued_tokens, active,
                               self.disable_chunked_mm_input or images_attend_both_ways)

    def _parallel_config(self, hf: HFModelConfig) -> ParallelConfig:
        tp, nnodes, port = self.tensor_parallel_size, self.nnodes, self.master_port
        _check(tp >= 1, f"tensor_parallel_size must be >= 1, got {tp}")
        _check(nnodes >= 1, f"nnodes must be >= 1, got {nnodes}")
        _check(0 <= self.node_rank < nnodes, f"node_rank must be in [0, {nnodes}), got {self.node_rank}")
        _check(tp % nnodes == 0, f"tensor_parallel_size={tp} must be a multiple of nnodes={nnodes} "
                                 "(every node runs the same number of ranks)")
        _check(port is None or 1 <= port <= 65535, f"master_port must be in [1, 65535], got {port}")
        _check(nnodes == 1 or port is not None, "master_port must be set when nnodes > 1: the other "
                                                "nodes join the rendezvous there")
        _check(bool(self.master_addr), "master_addr must not be empty")
        backend = self.distributed_executor_backend or ("mp" if tp > 1 else "uni")
        _check(backend in EXECUTOR_BACKENDS,
               f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}")
        _check(backend != "uni" or (tp == 1 and nnodes == 1),
               f"distributed_executor_backend='uni' runs a single worker; tensor_parallel_size={tp} "
               f"and nnodes={nnodes} need 'mp'")
        if backend == "external_launcher":
            _check_launcher_world(tp, nnodes, self.data_parallel_size)
        check_tensor_parallel_split(hf, tp)
        if self.worker_extension_cls:  # (imported here too: a bad name is refused before any process starts)
            from vllm_lite.rpc import resolve_qualname

            _check(isinstance(resolve_qualname(self.worker_extension_cls, "worker_extension_cls"), type),
                   f"worker_extension_cls={self.worker_extension_cls!r} is not a class")
        dp = self.data_parallel_size
        _check(isinstance(dp, int) and dp >= 1, f"data_parallel_size must be >= 1, got {dp!r}")
        _check(dp == 1 or (nnodes == 1 and port is None),
               "data_parallel_size > 1 runs its engines on this node, each with its own free port: nnodes and "
               "master_port are for one engine's tensor-parallel ranks across nodes")
        return ParallelConfig(tp, backend, nnodes, self.node_rank, self.master_addr, port,
                              self.worker_extension_cls, dp)


def _check_launcher_world(tp: int, nnodes: int, dp: int) -> None:
    """external_launcher's processes are torchrun's (or a job's with its process group made): their
    ranks are torchrun's, so vllm_lite's own multi-node and data-parallel launch do not apply."""
    _check(nnodes == 1 and dp == 1, "distributed_executor_backend='external_launcher' takes its ranks from the "
           "launcher (torchrun's RANK / WORLD_SIZE): nnodes and data_parallel_size stay 1")
    world = os.environ.get("WORLD_SIZE")
    _check(tp == 1 or world is not None, "distributed_executor_backend='external_launcher' runs in the processes "
           "torchrun starts (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT are not set here)")
    _check(world is None or (world.isdigit() and int(world) % tp == 0),
           f"distributed_executor_backend='external_launcher': WORLD_SIZE={world} processes cannot be split into "
           f"engines of tensor_parallel_size={tp}")


# sentence-transformers' module types (modules.json), as vLLM reads them
_ST_POOLING_MODULES = frozenset({"sentence_transformers.models.Pooling",
                                 "sentence_transformers.sentence_transformer.modules.pooling.Pooling"})
_ST_NORMALIZE_MODULES = frozenset({"sentence_transformers.models.Normalize",
                                   "sentence_transformers.base.modules.normalize.Normalize",
                                   "sentence_transformers.sentence_transformer.modules.normalize.Normalize"})
_POOLER_CONFIG_KEYS = frozenset({"pooling_type", "seq_pooling_type", "use_activation"})


def classifier_pooler_config(given: dict[str, Any] | None, hf: HFModelConfig, tokenizer: str) -> PoolerConfig:
    """A `*ForSequenceClassification` checkpoint's pooling: the last token by default (the
    transformers classifiers' rule), its labels from id2label (else num_labels, LABEL_i), and
    vLLM's activation: problem_type regression -> identity, multi_label_classification ->
    sigmoid, otherwise softmax, or sigmoid for one label (a cross-encoder's score); a
    sentence-transformers cross-encoder's `sbert_ce_default_activation_function` when it names
    torch's Sigmoid or Identity."""
    given = dict(given or {})
    unknown = sorted(set(given) - _POOLER_CONFIG_KEYS)
    _check(not unknown, f"pooler_config: {', '.join(unknown)} not implemented (implemented: "
                        f"{', '.join(sorted(_POOLER_CONFIG_KEYS))})")
    pooling_type = given.get("seq_pooling_type", given.get("pooling_type", "LAST"))
    _check(pooling_type in POOLING_TYPES, f"pooler_config: pooling_type must be one of {POOLING_TYPES}, "
                                          f"got {pooling_type!r}")
    use_activation = given.get("use_activation", True)
    _check(isinstance(use_activation, bool), f"pooler_config: use_activation must be a bool, got {use_activation!r}")
    raw = hf.raw
    token_ids, method = _classifier_tokens(raw, tokenizer)
    id2label = raw.get("id2label") or {}
    num_labels = raw.get("num_labels", len(id2label) or 2)
    if method is not None:
        num_labels = 1 if method == "from_2_way_softmax" else len(token_ids)
        id2label = {}
    _check(isinstance(num_labels, int) and num_labels >= 1, f"config.json: num_labels must be >= 1, got {num_labels!r}")
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    return PoolerConfig(pooling_type, use_activation, "classify", labels, _classifier_activation(raw, num_labels),
                        token_ids, method)


_CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


def _classifier_tokens(raw: dict[str, Any], tokenizer: str) -> tuple[tuple[int, ...], str | None]:
    """vLLM's classifier_from_token (with `method`, or `is_original_qwen3_reranker`: a
    Qwen3-Reranker given `hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}`): the tokens'
    ids in the tokenizer's vocabulary, and the method. None: the checkpoint has its own head."""
    tokens = raw.get("classifier_from_token")
    if not tokens:
        _check(not raw.get("is_original_qwen3_reranker"), "is_original_qwen3_reranker needs classifier_from_token "
                                                          '(vLLM\'s ["no", "yes"])')
        return (), None
    method = raw.get("method") or ("from_2_way_softmax" if raw.get("is_original_qwen3_reranker") else None)
    _check(method in _CLASSIFIER_METHODS, f"classifier_from_token needs method one of {_CLASSIFIER_METHODS} "
                                          f"(or is_original_qwen3_reranker), got {method!r}")
    _check(isinstance(tokens, list) and all(isinstance(t, str) for t in tokens) and
           (method != "from_2_way_softmax" or len(tokens) == 2),
           f"classifier_from_token must be a list of token strings (two for {method}), got {tokens!r}")
    tokenizer_file = Path(tokenizer) / "tokenizer.json"
    _check(tokenizer_file.is_file(), f"classifier_from_token needs the tokenizer's tokenizer.json ({tokenizer})")
    from tokenizers import Tokenizer

    vocabulary = Tokenizer.from_file(str(tokenizer_file))
    ids = tuple(vocabulary.token_to_id(token) for token in tokens)
    missing = [token for token, token_id in zip(tokens, ids) if token_id is None]
    _check(not missing, f"classifier_from_token: {missing} are not tokens of the vocabulary")
    return ids, method


_CROSS_ENCODER_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                              "torch.nn.modules.linear.Identity": "identity"}


def _classifier_activation(raw: dict[str, Any], num_labels: int) -> str:
    problem_type = raw.get("problem_type") or ""
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    named = (raw.get("sentence_transformers") or {}).get("activation_fn") or raw.get(
        "sbert_ce_default_activation_function")
    if named is not None and problem_type != "single_label_classification":
        _check(named in _CROSS_ENCODER_ACTIVATIONS, f"config.json: the cross-encoder activation {named!r} is not "
                                                    f"implemented (implemented: {', '.join(_CROSS_ENCODER_ACTIVATIONS)})")
        return _CROSS_ENCODER_ACTIVATIONS[named]
    return "sigmoid" if num_labels < 2 else "softmax"


def pooler_config(given: dict[str, Any] | None, model_dir: Path) -> PoolerConfig:
    """vLLM's rules: `given` (--pooler-config) over a sentence-transformers model's modules.json
    (its Pooling module's mode; normalized when it lists a Normalize module) over the default for
    a converted causal LM, the last token, normalized."""
    given = dict(given or {})
    _check("normalize" not in given, "pooler_config: `normalize` was removed in vLLM; use `use_activation`")
    unknown = sorted(set(given) - _POOLER_CONFIG_KEYS)
    _check(not unknown, f"pooler_config: {', '.join(unknown)} not implemented (implemented: "
                        f"{', '.join(sorted(_POOLER_CONFIG_KEYS))})")
    _check(not ("pooling_type" in given and "seq_pooling_type" in given
                and given["pooling_type"] != given["seq_pooling_type"]),
           "pooler_config: pooling_type and seq_pooling_type differ")
    from_model = _sentence_transformers_pooling(model_dir)
    pooling_type = given.get("seq_pooling_type", given.get("pooling_type", from_model.get("pooling_type", "LAST")))
    _check(pooling_type in POOLING_TYPES, f"pooler_config: pooling_type must be one of {POOLING_TYPES} (vLLM's "
                                          f"token-wise ALL and STEP are not implemented), got {pooling_type!r}")
    normalize = given.get("use_activation", from_model.get("normalize", True))
    _check(isinstance(normalize, bool), f"pooler_config: use_activation must be a bool, got {normalize!r}")
    return PoolerConfig(pooling_type, normalize)


def _sentence_transformers_pooling(model_dir: Path) -> dict[str, Any]:
    modules = _read_json_list(model_dir / "modules.json")
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING_MODULES), None)
    if pooling is None:
        return {}
    found: dict[str, Any] = {"normalize": any(m.get("type") in _ST_NORMALIZE_MODULES for m in modules)}
    settings = _read_json(model_dir / str(pooling.get("path", "")) / "config.json")
    _check(settings.get("include_prompt", True) is True, "sentence-transformers pooling with include_prompt=false "
                                                         "(an instruction left out of the pooling) is not implemented")
    for key, value in settings.items():
        name = value if key == "pooling_mode" and isinstance(value, str) else key if value is True else None
        kind = _st_pooling_name(name) if name else None
        if kind in POOLING_TYPES:
            found["pooling_type"] = kind
        elif kind is not None and key.startswith("pooling_mode"):
            raise ValueError(f"sentence-transformers pooling {name!r} ({model_dir / str(pooling.get('path'))}) is not "
                             f"implemented (implemented: {', '.join(POOLING_TYPES)})")
    return found


def _st_pooling_name(name: str) -> str:
    """vLLM's reading: pooling_mode_mean_tokens -> MEAN, pooling_mode_lasttoken -> LAST."""
    name = name.replace("pooling_mode_", "").split("_", 1)[0]
    return "LAST" if "lasttoken" in name else name.upper()


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    value = json.loads(path.read_text()) if path.is_file() else []
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def derived_max_model_len(hf: HFModelConfig, tokenizer_dir: str) -> tuple[int, str]:
    """The longest context the model takes, vLLM's rule, and where it comes from:
    `max_position_embeddings`, at most the tokenizer's `model_max_length`, stretched by the
    `factor` of a linear rope scaling (llama3, YaRN and longrope configs state the stretched
    length already; Gemma 3's is stated too)."""
    length, source = hf.max_position_embeddings, f"max_position_embeddings={hf.max_position_embeddings}"
    tokenizer_max = _read_json(Path(tokenizer_dir) / "tokenizer_config.json").get("model_max_length")
    if isinstance(tokenizer_max, (int, float)) and tokenizer_max < length:
        length, source = int(tokenizer_max), f"the tokenizer's model_max_length={int(tokenizer_max)}"
    factors = [rope["factor"] for rope in _rope_dicts(hf.raw) if rope_type_of(rope) == "linear"]
    if factors and "gemma3" not in str(hf.raw.get("model_type")):
        length = int(length * factors[0])
        source += f" x rope factor {factors[0]}"
    return length, source


def _rope_dicts(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's rope dicts: one, or one per layer type."""
    rope = _rope_source(cfg)
    if not isinstance(rope, dict):
        return []
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return list(rope.values())
    return [rope]


def smallest_sliding_window(hf: HFModelConfig) -> int | None:
    """The narrowest sliding window of the model's layers (vLLM's disable_sliding_window caps
    max_model_len there); None without one. The Transformers fallback's: config.json's
    `sliding_window`, unless `use_sliding_window` is false."""
    windows = [w for w in hf.sliding_windows if w is not None]
    if hf.model_impl == "transformers":
        window = hf.raw.get("sliding_window")
        if isinstance(window, int) and window >= 1 and hf.raw.get("use_sliding_window", True) is not False:
            windows.append(window)
    return min(windows, default=None)


def _allow_long_max_model_len(hf: HFModelConfig, max_len: int, model_len: int, source: str) -> None:
    """vLLM's rule for a max_model_len past the model's context: refused, unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (then a warning). Positions from a learned table (OPT, and
    the Transformers fallback, which may have one) have nothing past it: refused either way."""
    message = f"max_model_len={max_len} exceeds the model's context of {model_len} positions ({source})"
    if (hf.rope_scaling or {}).get("rope_type") == "yarn" and source.startswith("max_position_embeddings"):
        message += ("; a YaRN config states its stretched context in max_position_embeddings (as vLLM reads "
                    "it): hf_overrides={'max_position_embeddings': N} sets it")
    rotary = hf.model_impl == "vllm" and hf.architecture != "OPTForCausalLM"
    _check(os.environ.get(ALLOW_LONG_MAX_MODEL_LEN_ENV) == "1" and rotary,
           message + (f"; {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 allows it (vLLM's escape hatch: rotary positions past "
                      "the context the model was trained for degrade its output)" if rotary else
                      "; its positions come from a learned table, which has nothing past it"))
    logger.warning("%s: allowed by %s=1", message, ALLOW_LONG_MAX_MODEL_LEN_ENV)


def _default_max_model_len(hf: HFModelConfig, derived: int) -> int:
    """vLLM's default: the derived length, but a LongRoPE model's pretrained context (its short
    factors; the long ones are not implemented here)."""
    scaling = hf.rope_scaling or {}
    if scaling.get("rope_type") in ("longrope", "su"):
        return min(derived, scaling["original_max_position_embeddings"])
    return derived


def _check_longrope_length(hf: HFModelConfig, max_len: int) -> None:
    """LongRoPE's long factors (past `original_max_position_embeddings`) are not implemented:
    transformers switches a whole sequence to them once it grows past that length."""
    scaling = hf.rope_scaling or {}
    if hf.model_impl == "vllm" and scaling.get("rope_type") in ("longrope", "su"):
        original = scaling["original_max_position_embeddings"]
        _check(max_len <= original, f"max_model_len={max_len} exceeds original_max_position_embeddings="
                                    f"{original} of this longrope model; its long_factor scaling is not "
                                    f"implemented: set max_model_len <= {original}")


def check_tensor_parallel_split(hf: HFModelConfig, tp: int) -> None:
    """Refuse a model whose layers cannot be split over `tp` ranks, naming the dimension.
    The vocabulary always splits (it is padded); KV heads are replicated when fewer than ranks."""
    if tp == 1:  # (nothing to split; a fallback model's sizes may be per-layer lists: Gemma 3n's)
        return
    for name, value in (("num_attention_heads", hf.num_attention_heads),
                        ("intermediate_size", hf.intermediate_size),
                        ("moe_intermediate_size", hf.raw.get("moe_intermediate_size") or 0)):
        _check(value % tp == 0, f"{name}={value} is not divisible by tensor_parallel_size={tp}")
    kv = hf.num_key_value_heads
    if kv >= tp:
        _check(kv % tp == 0, f"num_key_value_heads={kv} is not divisible by tensor_parallel_size={tp}")
    else:
        _check(tp % kv == 0, f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={kv} "
                             "(KV heads are replicated over ranks only when the count divides)")


def _resolve_load_format(load_format: str, gguf_file: Path | None) -> str:
    """vLLM's load_format, as far as this engine reads checkpoints: safetensors folders and .gguf
    files (`auto` picks by the model), or `dummy` weights (random, for benchmarks)."""
    _check(load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS} (vLLM's others, e.g. 'pt' "
                                        f"for .bin files, are not implemented), got {load_format!r}")
    found = "gguf" if gguf_file is not None else "safetensors"
    _check(load_format in ("auto", "dummy", found),
           f"load_format={load_format!r}, but the model is a {'.gguf file' if gguf_file else 'safetensors folder'}")
    _check(load_format != "dummy" or gguf_file is None, "load_format='dummy' builds a folder's model (config.json) "
                                                        "with random weights; give the folder, not a .gguf file")
    return found if load_format == "auto" else load_format


def _resolve_device(device: str) -> str:
    _check(device in DEVICE_NAMES, f"device must be one of {DEVICE_NAMES}, got {device!r}")
    if device != "auto":
        return device
    if not torch_built_for_gpus():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_built_for_gpus() -> bool:
    """Whether the installed torch is a CUDA or ROCm build, told by its libraries' names: a CPU
    build never sees a GPU, and importing torch to ask takes ~2 s, which `vllm-lite serve` would
    spend before it starts the engine core (whose process imports torch anyway)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True  # torch itself answers (or fails to import) as it would have
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return any((lib / name).exists() for name in ("libtorch_cuda.so", "libtorch_hip.so"))


def _resolve_dtype(dtype: str, model_dtype: str, device: str) -> str:
    """`auto` takes the checkpoint's dtype on CUDA. On CPU it takes bfloat16 where the CPU has
    bf16 dot products in hardware (avx512_bf16 or AMX), else float32: elsewhere half-precision
    matmuls are emulated and slower than fp32. An explicit `dtype` always wins; the parity
    tests ask for float32."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        from vllm_lite.cpu_info import has_native_bf16

        chosen = "bfloat16" if has_native_bf16() else "float32"
        logger.info("dtype='auto' on CPU: %s (%s); pass dtype= to override", chosen,
                    "native bf16 dot products" if chosen == "bfloat16" else "no native bf16 dot products")
        return chosen
    if model_dtype not in DTYPE_SIZES:
        return "float32"
    return model_dtype


def _warn_int8_without_dot_products() -> None:
    """quantization="int8" is correct on any CPU but fast only with int8 dot products in hardware:
    without them torch._int_mm's portable kernel ran 25-50x slower than the float32 matmul (an
    AVX2-only AMD EPYC, benchmarks/RESULTS.md). Said once at start, as the dtype='auto' choice is."""
    from vllm_lite.cpu_info import has_native_int8

    if not has_native_int8():
        logger.warning("quantization='int8' on a CPU without int8 dot products (no avx512_vnni, avx_vnni or "
                       "amx_int8): its int8 matmuls are emulated and much slower than float32 here (the weights "
                       "still take a quarter of float32's memory)")


def _warn_slow_float16() -> None:
    """dtype="float16" on CPU is honoured, but without AMX-FP16 oneDNN's fp16 matmuls ran no faster
    than float32's (0.86-1.35x its time: an Intel Xeon with AMX-BF16 and avx512_fp16, where they
    also ran 2.3-8x slower than bf16's, and one with avx512_fp16 and avx512_bf16 but no AMX,
    benchmarks/half_precision.py in benchmarks/RESULTS.md). Said once at start, as the
    dtype='auto' choice is."""
    from vllm_lite.cpu_info import has_fast_fp16_matmul

    if not has_fast_fp16_matmul():
        logger.warning("dtype='float16' on a CPU without AMX-FP16: its matmuls run no faster than float32's here "
                       "(the weights take half the memory); dtype='auto' picks this CPU's fast precision")


def _resolve_checkpoint_quantization(quantization: str | None, checkpoint: str | None) -> str | None:
    """A checkpoint quantized already (compressed-tensors, AWQ, GPTQ, FP8) implies its method, as
    vLLM infers it from config.json; asking for another, or for it without one, is refused."""
    if checkpoint is None:
        _check(quantization not in CHECKPOINT_QUANTIZATIONS, f"quantization={quantization!r} needs a checkpoint "
               f"whose config.json has a {quantization} quantization_config")
        return quantization
    _check(quantization in (None, checkpoint), f"quantization={quantization!r}: the checkpoint is quantized "
           f"already (config.json quantization_config: {checkpoint}); leave quantization unset")
    return checkpoint


def _check_quantization_device(quantization: str | None, hf: HFModelConfig, device: str) -> None:
    """Off the CPU a quantized checkpoint runs on the float weights it stands for (FP8,
    bitsandbytes, MXFP4, AWQ, GPTQ and pack-quantized ones are read so on every device; the CPU
    alone keeps fitting 4-bit layers in GGUF Q4_1 blocks: model/loader.py), as a .gguf model
    does. What needs the CPU's int8 or GGUF kernels is refused there."""
    if device == "cpu" or quantization is None:
        return
    _check(quantization not in ("int8", "gguf"), f"quantization={quantization!r} runs on CPU only here: its int8 "
           f"or GGUF block matmuls are the CPU's kernels (device is {device!r})")
    checkpoint_format = (hf.raw.get("quantization_config") or {}).get("format")
    _check(not (quantization == "compressed-tensors" and checkpoint_format == "int-quantized"),
           f"config.json: a compressed-tensors int-quantized (W8A8 int8) checkpoint runs on CPU only here: its int8 "
           f"matmuls are the CPU's kernels (device is {device!r})")


def _resolve_gguf_quantization(quantization: str | None, gguf_file: Path | None, device: str,
                               tensor_parallel_size: int, model_impl: str) -> str | None:
    """A llama / Qwen2 / Qwen3 .gguf model on CPU implies quantization="gguf" (as vLLM infers it from
    the file); other architectures, CUDA and the Transformers fallback load it dequantized. To run
    a GGUF file dequantized on CPU, pass its converted folder (`vllm_lite.gguf_convert.gguf_model_dir`)."""
    if quantization not in (None, "gguf"):
        return quantization
    if gguf_file is None:
        _check(quantization is None, "quantization='gguf' needs a .gguf model file")
        return None
    from vllm_lite.gguf_convert import supports_kept_quantized

    keepable = supports_kept_quantized(gguf_file) and model_impl != "transformers"
    _check(quantization is None or keepable,
           f"quantization='gguf': '{gguf_file}' is not a llama / Qwen2 / Qwen3 GGUF file run by our model code; "
           "other architectures and model_impl='transformers' load it dequantized (leave quantization unset)")
    if device != "cpu" or not keepable:
        return None
    _check(tensor_parallel_size == 1, f"quantization='gguf' runs on one rank, got tensor_parallel_size="
                                      f"{tensor_parallel_size}; pass the converted folder to shard it")
    logger.info("quantization='gguf': %s keeps its Q4_1 / Q8_0 tensors in their blocks", gguf_file.name)
    return "gguf"


def _demo_gguf() -> Path:
    from vllm_lite.gguf_convert import find_demo_gguf

    return find_demo_gguf()


def _gguf_model_dir(gguf_path: Path) -> Path:
    from vllm_lite.gguf_convert import gguf_model_dir

    return gguf_model_dir(gguf_path)


def _demo_model_dir() -> Path:
    from vllm_lite.gguf_convert import ensure_demo_model

    return ensure_demo_model()


# vLLM's name for AsyncLLM's engine arguments (its extra logging fields are server flags here):
# the same class, so AsyncEngineArgs(model=..., enable_log_requests=True) is refused by name.
AsyncEngineArgs = EngineArgs


# vLLM's SpeculativeConfig fields this engine takes for the n-gram method, and those that only
# describe a draft model (taken at their default, None: refused otherwise, by name).
SPECULATIVE_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                      "disable_by_batch_size")
DRAFT_MODEL_FIELDS = ("draft_tensor_parallel_size", "quantization", "max_model_len", "revision", "code_revision",
                      "speculative_token_tree", "enforce_eager")
SPECULATIVE_METHODS = ("ngram", "draft_model", *EAGLE_METHODS, "medusa")
MAX_SPECULATIVE_TOKENS = 128  # vLLM's rejection sampler's limit (MAX_SPEC_LEN)
# vLLM's defaults when neither prompt_lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5


def speculative_config(given: Any) -> SpeculativeConfig:
    """vLLM's speculative_config dict, checked as vLLM checks it: the n-gram method and a draft
    model; what is not implemented (eagle, medusa, mtp heads, suffix decoding) refused by name."""
    _check(isinstance(given, dict), f"speculative_config must be a dict (vLLM's SpeculativeConfig fields), "
                                    f"got {type(given).__name__}")
    unknown = sorted(set(given) - set(SPECULATIVE_FIELDS) - set(DRAFT_MODEL_FIELDS))
    _check(not unknown, f"speculative_config: {', '.join(map(repr, unknown))} not implemented (implemented: "
                        f"{', '.join(SPECULATIVE_FIELDS)})")
    method, model = given.get("method"), given.get("model")
    if method is None and model in ("ngram", "[ngram]"):  # vLLM's older spelling
        method, model = "ngram", None
    if method is None and isinstance(model, str):  # (vLLM's inference: an EAGLE head by its name, else a draft)
        method = eagle_method_of(model) or "draft_model"
    _check(method in SPECULATIVE_METHODS, f"speculative_config: method={method!r} is not implemented (methods: "
                                          f"{', '.join(SPECULATIVE_METHODS)}; MTP heads and suffix decoding are "
                                          "not)")
    k = given.get("num_speculative_tokens")
    if method != "ngram":
        return _draft_model_speculation(given, method, model, k)
    _check(model is None, f"speculative_config: model={model!r} with method='ngram': prompt lookup has no model")
    drafting = [name for name in DRAFT_MODEL_FIELDS if given.get(name) is not None]
    _check(not drafting, f"speculative_config: {', '.join(drafting)} describe a draft model, which the n-gram "
                         "method has none of")
    _check(_is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS,
           f"speculative_config: num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low, high = (high if low is None else low), (low if high is None else high)
    for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        _check(_is_int(value) and value >= 1, f"speculative_config: {name} must be an integer >= 1, got {value!r}")
    _check(low <= high, f"speculative_config: prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    threshold = given.get("disable_by_batch_size")
    _check(threshold is None or (_is_int(threshold) and threshold >= 2),
           f"speculative_config: disable_by_batch_size must be an integer >= 2, got {threshold!r}")
    return SpeculativeConfig(k, low, high, threshold)


def _draft_model_speculation(given: dict[str, Any], method: str, model: Any, k: Any) -> SpeculativeConfig:
    """vLLM's methods "draft_model" (`model`, a folder or hub id, drafts k tokens a step greedily),
    "eagle" / "eagle3" and "medusa" (`model` is the head; a Medusa head's k may be left unset)."""
    _check(isinstance(model, str) and model, f"speculative_config: method={method!r} needs the draft's `model`")
    _check((k is None and method == "medusa") or (_is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS),
           f"speculative_config: num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
    lookup = [name for name in ("prompt_lookup_min", "prompt_lookup_max") if given.get(name) is not None]
    _check(not lookup, f"speculative_config: {', '.join(lookup)} are the n-gram method's, not a draft model's")
    given_others = {name: given[name] for name in DRAFT_MODEL_FIELDS if given.get(name) is not None}
    # (enforce_eager=True asks for what every drafter here does: run eagerly)
    unsupported = sorted(set(given_others) - {"draft_tensor_parallel_size"}
                         - ({"enforce_eager"} if given_others.get("enforce_eager") is True else set()))
    _check(not unsupported, f"speculative_config: {', '.join(unsupported)} for a draft model are not implemented "
                            "(the draft runs eagerly, at the model's length, unquantized)")
    threshold = given.get("disable_by_batch_size")
    _check(threshold is None or (_is_int(threshold) and threshold >= 2),
           f"speculative_config: disable_by_batch_size must be an integer >= 2, got {threshold!r}")
    return SpeculativeConfig(k, 0, 0, threshold, method=method, draft_model=model,
                             draft_tensor_parallel_size=given.get("draft_tensor_parallel_size"))


def _is_medusa_head(model: str, download_dir: str | None, hf_token: str | None) -> bool:
    config_path = resolve_model_path(model, None, download_dir, hf_token, weights=False) / "config.json"
    return config_path.is_file() and _read_json(config_path).get("model_type") == "medusa"


def _image_inputs(hf: HFModelConfig, cfg: dict[str, Any], language_model_only: bool
                  ) -> tuple[ImageEncoderConfig | None, str]:
    """The checkpoint's vision side where its image inputs are implemented, else None with the
    reason a request's image is refused."""
    architecture = hf.checkpoint_architecture
    if not is_multimodal(architecture):
        return None, f"{architecture} is a text model"
    if language_model_only:
        return None, "language_model_only=True serves the language model alone"
    if hf.model_impl != "vllm":
        return None, "its language model runs on the Transformers fallback, which takes no image features"
    try:
        return read_image_encoder(cfg), ""
    except ValueError as exc:
        return None, f"{exc}; the checkpoint is served as its language model"


def check_speculative_decoding(config: VllmConfig) -> None:
    """Where drafts run here: generating models whose KV cache keeps every block."""
    _check(config.model_config.pooler is None, "speculative_config: pooling models generate no tokens to draft")
    # (a Medusa head reads only the model's hidden states; a draft model and an EAGLE head read token ids)
    _check(not (config.model_config.enable_prompt_embeds and config.speculative_config.drafts_on_workers
                and config.speculative_config.method != "medusa"),
           "speculative_config with a draft model or EAGLE head and enable_prompt_embeds is not implemented (the "
           "draft reads prompts as token ids; prompt_embeds are the model's own input embeddings)")
    _check(not (config.model_config.max_images_per_prompt and config.speculative_config.drafts_on_workers
                and config.speculative_config.method != "medusa"),
           "speculative_config with a draft model or EAGLE head and image inputs is not implemented (the draft reads "
           "an image's placeholder tokens, not its features): give limit_mm_per_prompt={'image': 0} to serve the "
           "language model alone")
    _check(not config.model_config.logits_processors,
           "speculative_config with logits_processors is not implemented (a processor sees one row per request)")
    _check(config.cache_config.sliding_window is None,
           "speculative_config with a model whose every layer slides (its KV blocks outside the window are freed as "
           "it goes) is not implemented")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
