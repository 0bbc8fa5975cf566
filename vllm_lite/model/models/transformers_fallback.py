"""The Transformers fallback (vLLM's `model_impl="transformers"`): a decoder-only `*ForCausalLM`
that transformers can build runs with transformers' own modelling code, while its attention is
ours: the model is built with `attn_implementation="vllm_lite"`, an attention function
registered in transformers' AttentionInterface that writes each layer's keys and values into
our paged KV cache and attends through our backend. The scheduler feeds the whole step's
tokens as one sequence (batch 1, our positions); the attention metadata says where each
request starts, so the causal mask transformers would build is not needed (a mask function
that builds none is registered beside it).

Only models whose attention goes entirely through that interface qualify (transformers marks
them `_supports_attention_backend`): a model that adds a bias through the mask (ALiBi) would
otherwise lose it silently. One rank only: tensor parallelism needs a native implementation.

The decoder's `nn.Linear` layers become the engine's linear layers over the same parameters (as
vLLM's Transformers backend replaces them with its own): the CPU weight packing (oneDNN, AMX
tiles) and quantization="int8" then apply to them as to a native model's; the LM head stays
transformers' (quantization="int8" leaves a native model's in the model dtype too).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import HFModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.gated_delta_rule import GatedDeltaNetOnSlots, RecurrentStep
from vllm_lite.model.layers.linear import ReplicatedLinear
from vllm_lite.model.weight_updates import update_module_parameters
from vllm_lite.multimodal_checkpoints import is_multimodal, language_model_weights, transformers_config

ATTN_IMPLEMENTATION = "vllm_lite"
# keyword arguments transformers' attention modules pass that need nothing from us
_NEUTRAL_KWARGS = {"dropout": (0.0, None), "is_causal": (True, None), "position_ids": None,
                   "cache_position": None, "output_attentions": (False, None), "use_cache": None,
                   "past_key_values": (None,), "position_embeddings": None}


def _vllm_lite_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, scaling: float | None = None, **kwargs: Any):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None), through the
    backend with this layer's cache; `kv_caches` and `attn_metadata` ride in the kwargs. A load-time
    probe (`vllm_lite_probe`, a list) records each layer's key / value shapes instead."""
    probe = kwargs.pop("vllm_lite_probe", None)
    if probe is not None:
        causal = kwargs.get("is_causal") is not False and getattr(module, "is_causal", True) is not False
        probe.append(AttentionShape(key.shape[1], key.shape[-1], value.shape[-1], causal,
                                    getattr(module, "layer_idx", None)))
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1]), None
    if "vllm_lite_kv_caches" not in kwargs:
        raise ValueError(f"model_impl='transformers': {type(module).__name__} does not hand its model's keyword "
                         "arguments on to its attention, so it cannot reach the paged KV cache")
    kv_caches, metadata = kwargs.pop("vllm_lite_kv_caches"), kwargs.pop("vllm_lite_attn_metadata")
    backend: AttentionBackend = kwargs.pop("vllm_lite_backend")
    cache_head_dim: int = kwargs.pop("vllm_lite_head_dim")
    cache_kv_heads: int = kwargs.pop("vllm_lite_kv_heads")
    sliding_window, soft_cap = kwargs.pop("sliding_window", None), kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)  # (gpt-oss's attention sinks: one logit per head)
    _refuse_unknown(kwargs)
    scale = module.head_dim ** -0.5 if scaling is None else scaling
    # [T, H, D]; keys and values narrower than the cache's heads (latent attention's, a Gemma 4
    # sliding layer's) padded with zeros: q.k and the weighted sum of values are unchanged, the
    # padding is sliced off the output. Fewer KV heads than the cache's (a Gemma 4 global layer's)
    # are repeated in place: query head h still reads the KV head it shares.
    if key.shape[1] != cache_kv_heads:
        repeats = cache_kv_heads // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    q, k, v = (_padded(t[0].transpose(0, 1), cache_head_dim) for t in (query, key, value))
    out = backend.forward(q, k.contiguous(), v.contiguous(), kv_caches[module.layer_idx], metadata,
                          scale, sliding_window, soft_cap, sinks=None if sinks is None else sinks.float())
    return out[..., :value.shape[-1]].unsqueeze(0), None


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        allowed = _NEUTRAL_KWARGS.get(name, ())
        if name in _NEUTRAL_KWARGS and (allowed is None or value in allowed):
            continue
        if name.startswith("vllm_lite_") or value is None:
            continue
        raise ValueError(f"model_impl='transformers': the attention of this model passes {name}={value!r}, "
                         "which the vllm_lite attention does not implement")


# Class-name parts of layers that carry a recurrent state from step to step (a hybrid model's
# Mamba / SSM mixers, LFM2's short convolutions, gated-delta-net linear attention, RWKV): the
# fallback feeds a step's tokens of every request as one sequence, without that state.
# Matched as whole words of the class name (GptOssModel is no SSM).
_RECURRENT_LAYER_NAMES = ("mamba", "mamba2", "ssm", "short conv", "gated delta net", "linear attention", "rwkv", "recurrent")


def _words(class_name: str) -> str:
    """`Lfm2ShortConv` -> " lfm2 short conv " (its CamelCase words, lower case, space-separated)."""
    return " " + " ".join(re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", class_name)).lower() + " "


def _refuse_recurrent_layers(model: nn.Module, architecture: str) -> None:
    for name, module in model.named_modules():
        if isinstance(module, GatedDeltaNetOnSlots):
            continue
        kind = type(module).__name__
        words = _words(kind)
        if any(f" {part} " in words for part in _RECURRENT_LAYER_NAMES):
            raise ValueError(f"model_impl='transformers': {architecture} has layers that keep a per-request state "
                             f"from step to step ({name}: {kind}); the Transformers fallback runs only attention "
                             "models on the paged KV cache, so it cannot run here")


# What a transformers Gated DeltaNet layer holds that GatedDeltaNetOnSlots runs (Qwen3.5's; Qwen3-Next's
# fuses its projections otherwise and stays refused by `_refuse_recurrent_layers`)
_GATED_DELTA_NET_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj", "A_log",
                          "dt_bias", "layer_idx", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "activation")


def _linear_attention_on_slots(model: nn.Module) -> list[int]:
    """Each Gated DeltaNet layer replaced by one that keeps its state in the engine's slots;
    returns their layer indices."""
    replaced = []
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if all(hasattr(child, part) for part in _GATED_DELTA_NET_PARTS):
                setattr(parent, name, GatedDeltaNetOnSlots(child))
                replaced.append(child.layer_idx)
    return sorted(replaced)


def _check_linear_layers(replaced: list[int], config: HFModelConfig) -> None:
    """The layers that run on state slots must be the ones config.json's layer_types names
    (those get states, and no KV cache)."""
    expected = list(config.linear_attention_layers)
    if replaced != expected:
        raise ValueError(f"model_impl='transformers': {config.architecture}'s config.json names linear_attention "
                         f"layers {expected}, but its Gated DeltaNet layers that run here are {replaced}")


def _load_language_model(model: nn.Module, model_dir: Path, architecture: str) -> None:
    """A multimodal checkpoint's language-model tensors into transformers' text model (the vision
    and audio towers' are not read); a tensor it has no place for, or a parameter without one,
    is refused by name."""
    from vllm_lite.model.layers.linear import materialize
    from vllm_lite.model.checkpoint_files import iterate_weights

    state = {name: materialize(weight)
             for name, weight in language_model_weights(architecture, iterate_weights(model_dir))}
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint in '{model_dir}': {architecture}'s language model lacks tensors for "
                         f"{missing[:5]} and has no place for {result.unexpected_keys[:5]}")


def _engine_linear_layers(module: nn.Module) -> None:
    """Each plain `nn.Linear` under `module` replaced by a ReplicatedLinear holding its weight and
    bias (the same tensors); subclasses of nn.Linear, whose forward may differ, are kept."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            with torch.device("meta"):  # (its own parameters are replaced at once)
                layer = ReplicatedLinear(child.in_features, child.out_features, bias=child.bias is not None)
            layer.weight, layer.bias = child.weight, child.bias
            setattr(module, name, layer)
        else:
            _engine_linear_layers(child)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _dequantized(config: HFModelConfig) -> dict[str, Any]:
    """gpt-oss's MXFP4 experts are dequantized into the engine's dtype as transformers loads them
    (its MXFP4 kernels are not used: the same weights on every device)."""
    if config.quantization != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def register_attention() -> None:
    """Idempotent: transformers keeps the registry for the process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _vllm_lite_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


class _GivenHiddenStates(nn.Module):
    """Stands in for the base model while the `*ForCausalLM`'s own forward turns given hidden
    states into logits: its head and whatever follows the head (Cohere's logit_scale, Granite's
    logits_scaling, Gemma's soft cap, ...) are transformers' code, not a copy that could miss one."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> _HiddenStatesOnly:
        return _HiddenStatesOnly(self.hidden)


class _HiddenStatesOnly:
    """A base model's output holding only its last hidden states (also as item 0); any other
    field a forward reads (an MoE's router_logits, past_key_values, ...) is None, as it is when
    not asked for."""

    def __init__(self, hidden: torch.Tensor | None) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # (only for attributes not set above)
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __getitem__(self, index: int) -> torch.Tensor | None:
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What one layer's attention hands the KV cache: key heads, key and value head dims."""

    num_kv_heads: int
    key_dim: int
    value_dim: int
    causal: bool = True  # False: bidirectional (an encoder's, BERT-style models' without is_decoder)
    layer_idx: int | None = None  # the cache layer it reads and writes


@dataclass(frozen=True, slots=True)
class _AttentionSpec:
    num_kv_heads: int


@dataclass(frozen=True, slots=True)
class _LayerSpec:
    self_attn: _AttentionSpec


@dataclass(frozen=True, slots=True)
class _LayersView:
    """What the model runner reads to size the KV cache: `model.model.layers[0].self_attn`."""

    layers: tuple[_LayerSpec, ...]


class TransformersForCausalLM(nn.Module):
    # Transformers' modelling code is not written for CUDA graph capture: some families make host
    # tensors inside forward (Gemma 3n's AltUp epsilon; the grouped-mm experts of gpt-oss, OLMoE,
    # DeepSeek copy group sizes), which capture refuses. Its decode steps run eagerly on CUDA.
    cuda_graph_capturable = False

    def __init__(self, config: HFModelConfig, model_dir: Path, backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK, hf_overrides: dict[str, Any] | None = None,
                 dummy_weights: bool = False, dtype: torch.dtype = torch.float32) -> None:
        """Transformers loads the checkpoint itself (it knows each family's tensor names and
        conversions), with the config that `hf_overrides` changed, straight into the engine's
        `dtype` (a bf16 model never passes through float32: half the peak memory); `dummy_weights`:
        built from that config, no checkpoint read (load_format="dummy")."""
        super().__init__()
        if tp.size > 1:
            raise ValueError("model_impl='transformers' runs on one rank; tensor_parallel_size > 1 needs "
                             f"a native implementation of {config.architecture}")
        from transformers import AutoConfig, AutoModelForCausalLM

        register_attention()
        multimodal = is_multimodal(config.checkpoint_architecture)
        if multimodal:  # its language model: the text config (overrides applied) and its tensors
            hf_config = transformers_config(config.raw)
        else:
            hf_config = AutoConfig.from_pretrained(model_dir)
            hf_config.update(hf_overrides or {})
        try:
            if dummy_weights or multimodal:  # (dummy: the loader then sets them as for a native model)
                self.hf_model = AutoModelForCausalLM.from_config(
                    hf_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype)
            else:
                self.hf_model = AutoModelForCausalLM.from_pretrained(
                    model_dir, config=hf_config, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype,
                    **_dequantized(config))
        except KeyError as exc:  # (a model that picks its attention class from a fixed table: Falcon's)
            raise ValueError(f"model_impl='transformers': transformers' {config.architecture} has no place for "
                             f"an attention implementation of its own (it looked up {exc}), so it cannot run "
                             "on the paged KV cache") from None
        replaced = _linear_attention_on_slots(self.hf_model)
        _refuse_recurrent_layers(self.hf_model, config.architecture)  # (first: a hybrid's reason is its state)
        _check_linear_layers(replaced, config)
        # (transformers leaves the flag off for its hybrid models, whose linear layers its attention
        # backends cannot run; here those run on the engine's state slots, and their attention
        # layers are checked as any model's below)
        if not (type(self.hf_model)._supports_attention_backend or config.linear_attention is not None):
            raise ValueError(f"model_impl='transformers': {type(self.hf_model).__name__} does not route all "
                             "of its attention through transformers' attention interface (e.g. it adds "
                             "ALiBi biases through the mask), so it cannot run on the paged KV cache")
        if self.hf_model.base_model is self.hf_model:
            raise ValueError(f"model_impl='transformers': transformers' {config.architecture} names no base model "
                             f"({type(self.hf_model).__name__}.base_model_prefix), so its hidden states cannot be "
                             "taken apart from its head")
        if multimodal and not dummy_weights:
            _load_language_model(self.hf_model, model_dir, config.checkpoint_architecture)
        self.config = config
        self.backend = backend
        self._check_attention_shapes()
        _engine_linear_layers(self.hf_model.base_model)
        self._layers_view = _LayersView((_LayerSpec(_AttentionSpec(config.num_key_value_heads)),))
        object.__setattr__(self, "_given_hidden", _GivenHiddenStates())  # (not a submodule: no weights)
        self._check_head_takes_hidden_states(dtype)

    def quantize_int8(self) -> None:
        """quantization="int8" quantizes the decoder's linear layers (the engine's, see
        `_engine_linear_layers`); a model whose experts are stacked tensors that transformers'
        own code multiplies (3-D parameters) would keep most of its weights unquantized: refused
        by name. (A router, a 2-D parameter, stays in the model dtype as vLLM keeps it.)"""
        # (a Gated DeltaNet's depthwise convolution kernel [channels, 1, 4] is no stack of experts: it
        # stays in the model dtype, as vLLM keeps it)
        convolutions = {id(module.conv1d.weight) for module in self.hf_model.modules()
                        if isinstance(module, GatedDeltaNetOnSlots)}
        stacked = [name for name, param in self.hf_model.base_model.named_parameters()
                   if param.dim() > 2 and id(param) not in convolutions]
        if stacked:
            raise ValueError(f"quantization='int8' quantizes linear layers; {self.config.architecture} through the "
                             f"Transformers fallback keeps its experts in stacked tensors ({stacked[0]}, ...) that "
                             "transformers' own code multiplies, so they would stay unquantized: leave quantization "
                             "unset for it")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """vLLM's: weights replaced in place, named as transformers' model names its parameters
        (what a trainer of the same class sends from its `named_parameters()`; a multimodal
        checkpoint's language model under either of its name forms)."""
        architecture = self.config.checkpoint_architecture
        if is_multimodal(architecture):
            weights = language_model_weights(architecture, weights)
        return update_module_parameters(self.hf_model, weights)

    def _check_attention_shapes(self) -> None:
        """One forward over a few tokens records what each layer's attention would cache; the
        paged KV cache is sized from config.json (its KV heads, one head_dim for keys and values),
        so a model that caches other shapes (DeepSeek's multi-head latent attention, ...) is
        refused by name here rather than failing in its first step."""
        shapes: list[AttentionShape] = []
        config = self.config
        try:
            with torch.no_grad():
                self.hf_model.base_model(input_ids=torch.zeros(1, 2, dtype=torch.long),
                                         position_ids=torch.arange(2)[None], use_cache=False, vllm_lite_probe=shapes)
        except Exception as exc:  # (e.g. Kolibri's sparse layers, which want a mask of their own to overlay)
            raise ValueError(f"model_impl='transformers': {config.architecture}'s forward fails with the engine's "
                             f"attention in place of its own ({type(exc).__name__}: {exc}), so it cannot run on the "
                             "paged KV cache") from exc
        linear = config.linear_attention_layers
        attending = [layer for layer in range(config.num_hidden_layers) if layer not in linear]
        if len(shapes) < len(attending):
            beside = " beside its linear-attention ones" if linear else ""
            raise ValueError(f"model_impl='transformers': {config.architecture} attends in {len(shapes)} of its "
                             f"{len(attending)} layers{beside}; the others (Mamba, convolution or linear-attention "
                             "layers, or none) would run here without the per-request state they keep, so it cannot "
                             "run on the paged KV cache")
        if Counter(shape.layer_idx for shape in shapes) != Counter(attending):
            raise ValueError(f"model_impl='transformers': {config.architecture} attends {len(shapes)} times in its "
                             f"{config.num_hidden_layers} layers, not once per cache layer (e.g. differential "
                             "attention's two maps, or a layer run again in recurrent-depth cycles); the paged KV "
                             "cache holds one key and value per layer, so it cannot run here")
        if not all(shape.causal for shape in shapes):
            raise ValueError(f"model_impl='transformers': {config.architecture}'s attention is bidirectional (an "
                             "encoder's: a BERT-style model whose config.json leaves is_decoder false), which a "
                             "generating engine's causal attention cannot reproduce")
        expected = AttentionShape(config.num_key_value_heads, config.head_dim, config.head_dim)
        # (narrower heads are padded, fewer KV heads repeated: per_layer_cache_shape)
        wrong = next((shape for shape in shapes if expected.num_kv_heads % shape.num_kv_heads
                      or max(shape.key_dim, shape.value_dim) > expected.key_dim), None)
        if wrong is not None:
            raise ValueError(f"model_impl='transformers': {config.architecture}'s attention caches keys of "
                             f"{wrong.num_kv_heads} heads x {wrong.key_dim} and values of {wrong.value_dim} "
                             f"dimensions; the paged KV cache holds {expected.num_kv_heads} heads x "
                             f"{expected.key_dim} for both "
                             "(config.json's num_key_value_heads and head_dim), so it cannot run here")

    def _check_head_takes_hidden_states(self, dtype: torch.dtype) -> None:
        """`compute_logits` runs the model's own forward with its base model swapped for the given
        hidden states; a forward that reaches into its base model's parts instead of calling it
        (OPT's `model.decoder(...)`) cannot be fed so, and would fail in the first step that
        samples: refused here by name."""
        try:
            with torch.no_grad():
                self.compute_logits(torch.zeros(1, self.config.hidden_size, dtype=dtype))
        except AttributeError as exc:
            raise ValueError(f"model_impl='transformers': {type(self.hf_model).__name__}'s forward reaches into its base "
                             f"model's parts ({exc}) rather than calling it, so its head cannot be run on the engine's "
                             "hidden states") from None

    @property
    def model(self) -> _LayersView:
        return self._layers_view

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The transformers model's input embedding layer (what its `inputs_embeds` stand in for)."""
        return self.hf_model.get_input_embeddings()(input_ids)

    def forward(self, input_ids, positions, kv_caches, attn_metadata,
                inputs_embeds: torch.Tensor | None = None, recurrent: RecurrentStep | None = None) -> torch.Tensor:
        """`recurrent`: the step's linear-attention state slots (a hybrid model's, else None)."""
        base = self.hf_model.base_model
        tokens = dict(input_ids=input_ids[None]) if inputs_embeds is None else dict(inputs_embeds=inputs_embeds[None])
        out = base(**tokens, position_ids=positions[None], use_cache=False,
                   vllm_lite_kv_caches=kv_caches, vllm_lite_attn_metadata=attn_metadata,
                   vllm_lite_backend=self.backend, vllm_lite_head_dim=self.config.head_dim,
                   vllm_lite_kv_heads=self.config.num_key_value_heads, vllm_lite_recurrent=recurrent)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] from the transformers model's own forward, its base model
        swapped for the given hidden states for the call."""
        model, prefix, given = self.hf_model, self.hf_model.base_model_prefix, self._given_hidden
        base = model._modules[prefix]
        given.hidden = hidden_states[None]
        model._modules[prefix] = given
        try:
            rows = hidden_states.shape[0]
            logits = model(input_ids=torch.zeros(1, rows, dtype=torch.long), use_cache=False).logits
        finally:
            model._modules[prefix], given.hidden = base, None
        return logits[0].float()

    def compute_greedy_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Always None: the logits come from the transformers model's own forward."""
        return None
