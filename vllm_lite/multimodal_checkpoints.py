"""Multimodal checkpoints served as their language model (vLLM's `--language-model-only`).

Gemma 3 (4B and up), Mistral Small 3.1 / 3.2, LLaVA (1.5, NeXT, OneVision), InternVL (its
transformers-format checkpoints), Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and its MoE), PaliGemma (1
and 2) and SmolVLM
ship as one `*ForConditionalGeneration` checkpoint: a vision encoder, a projector and a language
model that is one of the decoders this engine implements. Text in, text out, those models are
their language model alone: a text token's hidden states never depend on the vision side, whose
output only replaces the embeddings of image placeholder tokens. So the language model is built
from the checkpoint's `text_config` (read as transformers reads it: its config classes fill the
defaults that hub configs leave out) and loaded from the checkpoint's language-model tensors; the
vision encoder's and projector's tensors are not read by it. Where a checkpoint's image inputs are
implemented (vision_config.IMAGE_ARCHITECTURES) the workers build its vision side beside it
(model/models/llava_vision.py, qwen2_vl_vision.py); other image, audio and video inputs are
refused by name.

Torch-free: the engine configuration reads this before any worker starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# The outer config's fields of every multimodal checkpoint here, besides its text_config: the
# metadata transformers writes (config_fields.COMMON_IGNORED) and what only the vision side reads.
_OUTER_FIELDS = frozenset({"text_config", "vision_config", "tie_word_embeddings", "initializer_range"})
# Qwen's VL models place a text token at the same position in all three M-RoPE sections
# (temporal, height, width: transformers' get_rope_index for text), so their rotary is plain rope.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_MROPE_TYPES = ("mrope",)


@dataclass(frozen=True, slots=True)
class LanguageModelOf:
    """How one multimodal architecture's language model is read."""

    # the text_config's model_type -> the (native) architecture it runs on
    text_architectures: Mapping[str, str]
    # the outer config's fields that only the vision encoder and projector read, and the image /
    # video placeholder token ids (they mark inputs this engine refuses)
    vision_fields: frozenset[str]
    # checkpoint tensor-name prefix -> this engine's (first match wins)
    text_prefixes: tuple[tuple[str, str], ...]
    # the vision encoder's and projector's tensors (not read)
    vision_prefixes: tuple[str, ...]
    # text_config fields the multimodal class reads otherwise than the text model's class,
    # accepted only at the values where the two agree
    text_restricted: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    # text_config fields the multimodal class fixes (its text class has no field for them), set so
    # for the text model's class; a config that says otherwise is refused
    text_fixed: Mapping[str, Any] = field(default_factory=dict)
    # text_config fields the multimodal class's config writes there for itself, which its text
    # model never reads: left out of the text model's config
    text_written: frozenset[str] = frozenset()


_LLAVA_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
# transformers before 4.52 saved a composite model's language model under `language_model.`, and
# it saves them so still; its newer in-memory names (`model.language_model.`) are vLLM's other form.
_COMPOSITE_TEXT = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                   ("model.language_model.", "model."), ("lm_head.", "lm_head."))
_COMPOSITE_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
_LLAVA_FIELDS = frozenset({"image_token_index", "image_token_id", "projector_hidden_act", "vision_feature_layer",
                           "vision_feature_select_strategy", "image_seq_length", "multimodal_projector_bias",
                           "ignore_index"})  # (the training loss's label to skip)
_QWEN_VL_FIELDS = frozenset({"image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                             "vision_token_id"})
# Qwen2-VL / Qwen2.5-VL: the language model's tensors under `model.` (no `language_model.`) in the
# released checkpoints
_QWEN_VL_TEXT = (("model.language_model.", "model."), ("model.", "model."), ("lm_head.", "lm_head."))
_QWEN_VL_VISION = ("visual.", "model.visual.")

LANGUAGE_MODELS: Mapping[str, LanguageModelOf] = {
    "Gemma3ForConditionalGeneration": LanguageModelOf(
        text_architectures={"gemma3_text": "Gemma3ForCausalLM"},
        vision_fields=frozenset({"mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index",
                                 "boi_token_id", "eoi_token_id", "image_token_id"}),
        text_prefixes=_COMPOSITE_TEXT, vision_prefixes=_COMPOSITE_VISION,
        # (transformers' Gemma3ForConditionalGeneration leaves it out, vLLM's applies it; Gemma 3's
        # releases have none)
        text_restricted={"final_logit_softcapping": (None,)}),
    # (its text model runs on the Transformers fallback)
    "Gemma3nForConditionalGeneration": LanguageModelOf(
        text_architectures={"gemma3n_text": "Gemma3nForCausalLM"},
        vision_fields=frozenset({"audio_config", "audio_soft_tokens_per_image", "vision_soft_tokens_per_image",
                                 "audio_token_id", "boa_token_id", "eoa_token_id", "boi_token_id", "eoi_token_id",
                                 "image_token_id"}),
        text_prefixes=_COMPOSITE_TEXT,
        vision_prefixes=(*_COMPOSITE_VISION, "audio_tower.", "embed_vision.", "embed_audio.", "model.audio_tower.",
                         "model.embed_vision.", "model.embed_audio.")),
    # (its text model runs on the Transformers fallback)
    "Gemma4ForConditionalGeneration": LanguageModelOf(
        text_architectures={"gemma4_text": "Gemma4ForCausalLM"},
        vision_fields=frozenset({"audio_config", "boi_token_id", "eoi_token_id", "image_token_id",
                                 "video_token_id", "boa_token_id", "eoa_token_index", "audio_token_id"}),
        text_prefixes=_COMPOSITE_TEXT,
        vision_prefixes=(*_COMPOSITE_VISION, "audio_tower.", "embed_vision.", "embed_audio.", "model.audio_tower.",
                         "model.embed_vision.", "model.embed_audio.")),
    "Mistral3ForConditionalGeneration": LanguageModelOf(
        text_architectures={"mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM"},
        vision_fields=_LLAVA_FIELDS | {"spatial_merge_size"},
        text_prefixes=_COMPOSITE_TEXT, vision_prefixes=_COMPOSITE_VISION),
    "LlavaForConditionalGeneration": LanguageModelOf(
        text_architectures=_LLAVA_TEXT, vision_fields=_LLAVA_FIELDS,
        text_prefixes=_COMPOSITE_TEXT, vision_prefixes=_COMPOSITE_VISION),
    "LlavaNextForConditionalGeneration": LanguageModelOf(
        text_architectures=_LLAVA_TEXT,
        vision_fields=_LLAVA_FIELDS | {"image_grid_pinpoints", "use_image_newline_parameter"},
        text_prefixes=_COMPOSITE_TEXT,
        vision_prefixes=(*_COMPOSITE_VISION, "image_newline", "model.image_newline")),
    "LlavaOnevisionForConditionalGeneration": LanguageModelOf(
        text_architectures=_LLAVA_TEXT,
        vision_fields=_LLAVA_FIELDS | {"image_grid_pinpoints", "video_token_index", "video_token_id",
                                       "vision_aspect_ratio"},
        text_prefixes=_COMPOSITE_TEXT,
        vision_prefixes=(*_COMPOSITE_VISION, "image_newline", "model.image_newline")),
    "InternVLForConditionalGeneration": LanguageModelOf(
        text_architectures={"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"},
        vision_fields=_LLAVA_FIELDS | {"downsample_ratio"},
        text_prefixes=_COMPOSITE_TEXT, vision_prefixes=_COMPOSITE_VISION),
    "Qwen2VLForConditionalGeneration": LanguageModelOf(
        text_architectures={"qwen2_vl_text": "Qwen2ForCausalLM"}, vision_fields=_QWEN_VL_FIELDS,
        text_prefixes=_QWEN_VL_TEXT, vision_prefixes=_QWEN_VL_VISION),
    "Qwen2_5_VLForConditionalGeneration": LanguageModelOf(
        text_architectures={"qwen2_5_vl_text": "Qwen2ForCausalLM"}, vision_fields=_QWEN_VL_FIELDS,
        text_prefixes=_QWEN_VL_TEXT, vision_prefixes=_QWEN_VL_VISION),
    "Qwen3VLForConditionalGeneration": LanguageModelOf(
        text_architectures={"qwen3_vl_text": "Qwen3ForCausalLM"}, vision_fields=_QWEN_VL_FIELDS,
        text_prefixes=_QWEN_VL_TEXT, vision_prefixes=_QWEN_VL_VISION),
    # (its text model runs on the Transformers fallback, its Gated DeltaNet layers on the engine's
    # state slots; `mtp.`: the multi-token-prediction head vLLM drafts with, not read here)
    "Qwen3_5ForConditionalGeneration": LanguageModelOf(
        text_architectures={"qwen3_5_text": "Qwen3_5ForCausalLM"}, vision_fields=_QWEN_VL_FIELDS,
        text_prefixes=_QWEN_VL_TEXT, vision_prefixes=(*_QWEN_VL_VISION, "mtp.")),
    # (its experts' tensors are stacked: moe.py reads them; its router always renormalizes the
    # top-k weights, as transformers' Qwen3VLMoeTextTopKRouter)
    "Qwen3VLMoeForConditionalGeneration": LanguageModelOf(
        text_architectures={"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"}, vision_fields=_QWEN_VL_FIELDS,
        text_prefixes=_QWEN_VL_TEXT, vision_prefixes=_QWEN_VL_VISION, text_fixed={"norm_topk_prob": True}),
    # (PaliGemma's config writes its image count and a bidirectional flag into its text config:
    # PaliGemmaModel gives its language model the attention mask itself, whose two-way part covers
    # its prompt prefix when the processor's token_type_ids say so; this engine's covers each
    # image's placeholders, as vLLM's "mm prefix LM" does: vision_config.py)
    "PaliGemmaForConditionalGeneration": LanguageModelOf(
        text_architectures={"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"},
        # (`_vocab_size`: transformers 4.4x's saved name of a vocabulary size its modelling code
        # no longer reads; the text config's is the model's)
        vision_fields=frozenset({"image_token_index", "image_token_id", "projection_dim", "hidden_size",
                                 "ignore_index", "_vocab_size"}),
        text_prefixes=_COMPOSITE_TEXT, vision_prefixes=_COMPOSITE_VISION,
        text_written=frozenset({"num_image_tokens", "use_bidirectional_attention"})),
    "SmolVLMForConditionalGeneration": LanguageModelOf(
        text_architectures={"llama": "LlamaForCausalLM"},
        vision_fields=frozenset({"image_token_id", "scale_factor", "_pad_token_id", "pad_token_id"}),
        text_prefixes=(("model.text_model.", "model."), ("lm_head.", "lm_head.")),
        vision_prefixes=("model.vision_model.", "model.connector.")),
    "Idefics3ForConditionalGeneration": LanguageModelOf(
        text_architectures={"llama": "LlamaForCausalLM"},
        vision_fields=frozenset({"image_token_id", "scale_factor", "_pad_token_id", "pad_token_id"}),
        text_prefixes=(("model.text_model.", "model."), ("lm_head.", "lm_head.")),
        vision_prefixes=("model.vision_model.", "model.connector.")),
}


def is_multimodal(architecture: str) -> bool:
    return architecture in LANGUAGE_MODELS


def language_model_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config.json as its language model's: the text_config as
    transformers completes it, naming the architecture it runs on, with the outer config's
    embedding tying, dtype and end-of-sequence ids. Raises ValueError naming a field that cannot
    be honoured (an outer field that is neither the vision side's nor
    metadata, a text model without a native implementation)."""
    from vllm_lite.config_fields import COMMON_IGNORED

    architecture = cfg["architectures"][0]
    spec = LANGUAGE_MODELS[architecture]
    outer = transformers_config({name: value for name, value in cfg.items() if name != "quantization_config"})
    text = outer.get_text_config().to_dict()
    # older Qwen2-VL configs keep the text fields at the top, which transformers moves into its text
    # config (rope_theta and rope_scaling into rope_parameters)
    moved_to_text = set(text) | {"rope_theta", "rope_scaling"} if "text_config" not in cfg else set()
    # (older LLaVA / Idefics3 configs repeat the language model's vocab_size at the top)
    if "vocab_size" in cfg and "text_config" in cfg and cfg["vocab_size"] != text.get("vocab_size"):
        raise ValueError(f"config.json: vocab_size={cfg['vocab_size']} and text_config.vocab_size="
                         f"{text.get('vocab_size')} disagree; refusing to load rather than pick one")
    for name in cfg:
        if name not in (_OUTER_FIELDS | spec.vision_fields | COMMON_IGNORED | moved_to_text
                        | {"quantization_config", "vocab_size"}):
            raise ValueError(f"config.json: field {name!r} is not implemented for {architecture}; "
                             "refusing to load rather than ignore it")
    text_type = text.get("model_type")
    text_architecture = spec.text_architectures.get(text_type)
    if text_architecture is None:
        raise ValueError(f"config.json: text_config.model_type {text_type!r} of {architecture} is not supported "
                         f"(supported: {', '.join(sorted(spec.text_architectures))})")
    for name, allowed in spec.text_restricted.items():
        if text.get(name) not in allowed:
            raise ValueError(f"config.json: text_config.{name}={text.get(name)!r} is not supported for {architecture} "
                             f"(supported: {', '.join(map(repr, allowed))})")
    for name, value in spec.text_fixed.items():
        if text.get(name, value) != value:
            raise ValueError(f"config.json: text_config.{name}={text[name]!r} is not supported for {architecture} "
                             f"(its model reads {value!r})")
    text = {name: _without_mrope(value) if name in ("rope_parameters", "rope_scaling") else value
            for name, value in {**text, **spec.text_fixed}.items() if name not in spec.text_written}
    text["architectures"] = [text_architecture]
    text["tie_word_embeddings"] = _tied(outer.tie_word_embeddings, text.get("tie_word_embeddings"))
    text["dtype"] = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("dtype")
    if cfg.get("eos_token_id") is not None:
        text["eos_token_id"] = cfg["eos_token_id"]
    # (a quantized checkpoint says per tensor which layers are quantized: the vision side's, which
    # its ignore list usually leaves unquantized, are not read)
    text["quantization_config"] = cfg.get("quantization_config")
    return text


def _tied(outer_tie: Any, text_tie: Any) -> bool:
    """Whether the LM head is the embedding: only where the outer config and the text config (as
    their classes read them) both say so. transformers 5 ties by the outer config alone, whose
    class default is True for Mistral 3, but transformers 4 (which wrote the released checkpoints)
    and vLLM tie by the text config: Mistral Small 3.1's config says nothing at the top, its text
    config is untied, and its checkpoint has the LM head. Where they disagree the head is read from
    the checkpoint, whose lack of one is then an error naming it rather than a silent choice."""
    return bool(outer_tie) and (text_tie is None or bool(text_tie))


def transformers_config(cfg: Mapping[str, Any]) -> Any:
    """`cfg` (a config.json's dict) as transformers' config class for its model_type reads it."""
    from transformers import AutoConfig

    given = {name: value for name, value in cfg.items() if name != "model_type"}
    try:
        return AutoConfig.for_model(cfg.get("model_type"), **given)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"config.json: transformers cannot read this {cfg['architectures'][0]} config: {exc}") from exc


def _without_mrope(rope: Any) -> Any:
    if not isinstance(rope, Mapping):
        return rope
    if set(rope) <= {"full_attention", "sliding_attention"}:  # one per layer type
        return {layer_type: _without_mrope(sub) for layer_type, sub in rope.items()}
    plain = {key: value for key, value in rope.items() if key not in _MROPE_KEYS}
    if plain.get("type") in _MROPE_TYPES:
        plain.pop("type")
    return plain


def language_model_weights(architecture: str, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's language-model tensors under this engine's names; the vision encoder's
    and projector's are skipped, any other tensor passes unchanged (and is refused by the loader
    as one no parameter takes)."""
    spec = LANGUAGE_MODELS[architecture]
    for name, weight in weights:
        if not is_vision_tensor(architecture, name):
            yield language_model_name(spec, name), weight


def language_model_name(spec: LanguageModelOf, name: str) -> str:
    for prefix, ours in spec.text_prefixes:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def is_vision_tensor(architecture: str, name: str) -> bool:
    spec = LANGUAGE_MODELS.get(architecture)
    return spec is not None and name.startswith(spec.vision_prefixes)


def adapter_module_name(architecture: str, name: str) -> str:
    """A LoRA adapter's module (PEFT names it as the model class's module tree: either of
    transformers' forms) as this engine's checkpoint name; the identity for other architectures.
    A module of the vision encoder or projector, which are not loaded, is refused (ValueError)."""
    spec = LANGUAGE_MODELS.get(architecture)
    if spec is None:
        return name
    if is_vision_tensor(architecture, name):
        raise ValueError(f"module {name!r} belongs to {architecture}'s vision encoder or projector, which are not "
                         "loaded (only its language model is served; LoRA of the vision side is not implemented)")
    return language_model_name(spec, name)
