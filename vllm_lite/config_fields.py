"""Which Hugging Face `config.json` fields each supported architecture implements, ignores or
refuses. Nothing in a model's config is dropped silently: loading reads the whole dict and every
key must be in one of three classes for the architecture, or loading stops naming the key.

| class       | meaning                                                                   |
|-------------|---------------------------------------------------------------------------|
| implemented | read and honoured by our model code, any valid value                      |
| ignored     | does not change the math (metadata, training-only, generation defaults)   |
| restricted  | changes the math; accepted only at the listed values (absent = accepted)  |

The rope dict (`rope_parameters` / `rope_scaling`) is checked separately: its `rope_type` must be
one the architecture implements. tests/test_config_fields.py walks the transformers config class
of every architecture here and fails on any attribute that is not classified.

Torch-free and import-light: the engine configuration checks a model before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Metadata, training-only knobs and generation defaults that transformers writes into configs.
COMMON_IGNORED = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # (a classifier's labels, problem type and cross-encoder activation: read by config.classifier_pooler_config)
    "use_cache", "initializer_range", "id2label", "label2id", "num_labels", "problem_type",
    "sbert_ce_default_activation_function", "sentence_transformers",
    # (vLLM's classifier from language-model rows: a Qwen3-Reranker through hf_overrides)
    "classifier_from_token", "method", "is_original_qwen3_reranker",
    "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "attention_dropout", "tokenizer_class", "finetuning_task", "prefix", "task_specific_params",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "_attn_implementation_autoset",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "output_router_logits", "router_aux_loss_coef",
    "ignore_keys_at_rope_validation",  # transformers' bookkeeping for its own rope-dict check
    "pretraining_tp",  # a training-time slicing of the same matmuls; transformers 5 ignores it
    # custom-code classes a repository offers; with a native (or transformers') implementation
    # they are not used (as with transformers' trust_remote_code=False); see _refuse_remote_code
    "auto_map",
    # an embedding model's Matryoshka training (vLLM reads them): they allow a request's
    # `dimensions` (pooling_params.resolve_pooling), the model's math is the same
    "is_matryoshka", "matryoshka_dimensions",
})

# Changes the math at any non-neutral value; no supported architecture implements these.
COMMON_RESTRICTED: Mapping[str, tuple[Any, ...]] = {
    "is_encoder_decoder": (False,),
    "is_decoder": (False, True),  # a decoder-only model is a decoder either way
    "add_cross_attention": (False,),
    "cross_attention_hidden_size": (None,),
    "tie_encoder_decoder": (False,),
    # quantized checkpoints: compressed-tensors W8A8 int8, AWQ and GPTQ, by native implementations
    # (check_quantization_config); the transformers fallback loads gpt-oss's mxfp4 only
    "quantization_config": (None,),
}

# Core dense-decoder fields every architecture here reads.
DENSE_IMPLEMENTED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
})
ROPE_KEYS_IGNORED = frozenset({"rope_type", "type", "rope_theta"})
ROPE_KEYS_BY_TYPE: Mapping[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "longrope": frozenset({"long_factor", "short_factor", "factor", "attention_factor",
                           "original_max_position_embeddings"}),
    "su": frozenset({"long_factor", "short_factor", "factor", "attention_factor",
                     "original_max_position_embeddings"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                       "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}
# What transformers' rope validation requires of each type (it refuses a config without them).
ROPE_REQUIRED_KEYS: Mapping[str, frozenset[str]] = {
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
    "yarn": frozenset({"factor"}),
    "longrope": frozenset({"short_factor", "long_factor"}),
    "su": frozenset({"short_factor", "long_factor"}),
}
SLIDING_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True)
class FieldPolicy:
    implemented: frozenset[str]
    ignored: frozenset[str] = frozenset()
    restricted: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    rope_types: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
    # the rope dict's partial_rotary_factor may be below 1.0 (the model rotates that share)
    partial_rotary: bool = False
    # transformers' value for a field a config.json may leave out, where it is not the one the
    # generic reader assumes (no window, untied embeddings, no soft cap, ...)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # the generic names a config gives under its family's own (GPT-2's n_embd is hidden_size, ...)
    aliases: Mapping[str, str] = field(default_factory=dict)

    def all_fields(self) -> frozenset[str]:
        return (self.implemented | self.ignored | COMMON_IGNORED | frozenset(self.restricted)
                | frozenset(COMMON_RESTRICTED))


_LLAMA = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias", "mlp_bias"},
    restricted={"hidden_act": ("silu",)},
)
_GRANITE = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias", "mlp_bias", "embedding_multiplier", "residual_multiplier",
                                     "attention_multiplier", "logits_scaling"},
    restricted={"hidden_act": ("silu",)},
    # transformers' GraniteConfig defaults (an attention multiplier of 1.0 is the softmax scale itself)
    defaults={"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
              "logits_scaling": 1.0},
)
_SMOLLM3 = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval"},
    # with use_sliding_window false (SmolLM3's release) neither the window nor the layer types are read
    ignored=frozenset({"sliding_window", "layer_types"}),
    restricted={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    defaults={"max_position_embeddings": 32768, "num_key_value_heads": 4, "tie_word_embeddings": True,
              "rope_parameters": {"rope_theta": 2000000.0, "rope_type": "default"}},
)
_STARCODER2 = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"norm_epsilon", "use_bias", "sliding_window"},
    ignored=frozenset({"residual_dropout", "embedding_dropout"}),
    restricted={"hidden_act": ("gelu_pytorch_tanh",)},
    defaults={"max_position_embeddings": 4096, "num_key_value_heads": 2, "tie_word_embeddings": True,
              "hidden_act": "gelu_pytorch_tanh"},
)
_OLMO2 = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias"},
    restricted={"hidden_act": ("silu",)},
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
)
_MISTRAL = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"sliding_window"},
    defaults={"sliding_window": 4096, "num_key_value_heads": 8, "max_position_embeddings": 131072},
    # transformers' Mistral has no q/k/v/o or MLP biases whatever these say (it never reads them)
    ignored=frozenset({"attention_bias", "mlp_bias"}),
    restricted={"hidden_act": ("silu",), "layer_types": (None,)},
)
_QWEN2 = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"use_sliding_window", "sliding_window", "max_window_layers",
                                     "layer_types"},
    # q/k/v always have biases in Qwen2 (and o_proj none): transformers never reads the flag
    ignored=frozenset({"attention_bias"}),
    restricted={"hidden_act": ("silu",)},
    defaults={"max_position_embeddings": 32768},
)
_QWEN3 = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias", "use_sliding_window", "sliding_window",
                                     "max_window_layers", "layer_types"},
    restricted={"hidden_act": ("silu",)},
    defaults={"max_position_embeddings": 32768},
)

_MIXTRAL = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
    # no attention or MLP biases in transformers' Mixtral; router jitter is training-only
    ignored=frozenset({"attention_bias", "mlp_bias", "router_jitter_noise"}),
    restricted={"hidden_act": ("silu",)},
    defaults={"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
              "max_position_embeddings": 131072, "num_local_experts": 8, "num_experts_per_tok": 2},
)
_QWEN3_MOE = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias", "use_sliding_window", "sliding_window",
                                     "num_experts", "num_local_experts", "num_experts_per_tok",
                                     "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                     "mlp_only_layers"},
    # transformers' Qwen3-MoE slides every layer when use_sliding_window: it never reads this
    ignored=frozenset({"max_window_layers"}),
    restricted={"hidden_act": ("silu",)},
    defaults={"num_key_value_heads": 4, "max_position_embeddings": 32768, "num_experts": 128,
              "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
              "decoder_sparse_step": 1},
)

_GEMMA_IMPLEMENTED = DENSE_IMPLEMENTED | {
    "attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
    "attn_logit_softcapping", "final_logit_softcapping"}
_GEMMA_DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh"}
_GEMMA = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"attention_bias"},
    # "gelu" is a legacy value of the official releases that transformers reads as the tanh form
    restricted={"hidden_act": ("gelu_pytorch_tanh", "gelu"), "hidden_activation": (None, "gelu_pytorch_tanh"),
                "use_bidirectional_attention": (None, False)},
    defaults={"tie_word_embeddings": True, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "num_key_value_heads": 16, "max_position_embeddings": 8192},
)
_GEMMA2 = FieldPolicy(
    implemented=_GEMMA_IMPLEMENTED,
    # transformers' Gemma reads hidden_activation; hub configs carry hidden_act beside it
    ignored=frozenset({"hidden_act", "cache_implementation"}),
    restricted={"hidden_activation": ("gelu_pytorch_tanh",), "use_bidirectional_attention": (None, False)},
    defaults={**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
              "num_key_value_heads": 4, "max_position_embeddings": 8192},
)
_GEMMA3 = FieldPolicy(
    implemented=_GEMMA_IMPLEMENTED | {"rope_local_base_freq", "sliding_window_pattern",
                                      "_sliding_window_pattern"},
    ignored=frozenset({"hidden_act", "cache_implementation"}),
    restricted={"hidden_activation": ("gelu_pytorch_tanh",), "use_bidirectional_attention": (None, False)},
    defaults={**_GEMMA_DEFAULTS, "num_key_value_heads": 4, "max_position_embeddings": 131072},
)

_PHI3 = FieldPolicy(
    # (partial_rotary_factor: Phi-4-mini turns 3/4 of each head's dimensions)
    implemented=DENSE_IMPLEMENTED | {"sliding_window", "original_max_position_embeddings", "partial_rotary_factor"},
    # dropouts are training-only; transformers' Phi-3 has no attention or MLP biases
    ignored=frozenset({"embd_pdrop", "resid_pdrop", "attention_bias", "mlp_bias"}),
    restricted={"hidden_act": ("silu",)},
    rope_types=("default", "longrope", "su"),
    partial_rotary=True,
    defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "original_max_position_embeddings": 4096},
)

_OPT = FieldPolicy(
    implemented=frozenset({"vocab_size", "hidden_size", "ffn_dim", "num_hidden_layers",
                           "num_attention_heads", "max_position_embeddings", "tie_word_embeddings",
                           "do_layer_norm_before", "_remove_final_layer_norm", "word_embed_proj_dim",
                           "enable_bias", "layer_norm_elementwise_affine"}),
    ignored=frozenset({"dropout", "activation_dropout", "layerdrop", "init_std"}),  # training-only
    restricted={"activation_function": ("relu",)},
    rope_types=(),
    defaults={"tie_word_embeddings": True, "max_position_embeddings": 2048},
)

_GPT_NEOX = FieldPolicy(
    implemented=frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "max_position_embeddings", "tie_word_embeddings",
                           "rope_theta", "rope_scaling", "rope_parameters", "rotary_pct", "rotary_emb_base",
                           "partial_rotary_factor", "layer_norm_eps", "use_parallel_residual", "attention_bias"}),
    ignored=frozenset({"hidden_dropout", "classifier_dropout"}),  # training-only
    # "gelu" is exact; the tanh forms (gelu_new, gelu_fast, gelu_pytorch_tanh) are one formula
    restricted={"hidden_act": ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")},
    rope_types=("default", "linear"),
    partial_rotary=True,
    # transformers' GPTNeoXConfig (its rotary_pct default, 0.25, is config.py's: the rope dict may carry the value)
    defaults={"layer_norm_eps": 1e-5, "use_parallel_residual": True,
              "hidden_act": "gelu", "max_position_embeddings": 2048, "intermediate_size": 24576},
)

_PHI = FieldPolicy(
    implemented=DENSE_IMPLEMENTED - {"rms_norm_eps"} | {"partial_rotary_factor", "layer_norm_eps"},
    ignored=frozenset({"resid_pdrop", "embd_pdrop"}),  # training-only
    restricted={"hidden_act": ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh"), "qk_layernorm": (False,)},
    rope_types=("default", "linear"),
    partial_rotary=True,
    # transformers' PhiConfig (its partial_rotary_factor default, 0.5, is config.py's)
    defaults={"layer_norm_eps": 1e-5, "hidden_act": "gelu_new", "max_position_embeddings": 2048,
              "intermediate_size": 8192},
)

_STABLELM = FieldPolicy(
    implemented=DENSE_IMPLEMENTED - {"rms_norm_eps"} | {"partial_rotary_factor", "layer_norm_eps", "use_qkv_bias",
                                                      "use_parallel_residual"},
    ignored=frozenset({"hidden_dropout"}),  # training-only
    # qk_layernorm (StableLM 2 12B's per-head LayerNorm on q and k) is not implemented
    restricted={"hidden_act": ("silu",), "qk_layernorm": (False,)},
    rope_types=("default", "linear"),
    partial_rotary=True,
    # transformers' StableLmConfig (its partial_rotary_factor default, 0.25, is config.py's)
    defaults={"layer_norm_eps": 1e-5, "use_parallel_residual": False, "max_position_embeddings": 4096,
              "intermediate_size": 6912},
)

# GPT-2's names (transformers' attribute_map), GPTBigCode's too
_GPT_ALIASES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                "max_position_embeddings": "n_positions", "intermediate_size": "n_inner",
                "hidden_act": "activation_function"}
_GPT_GELUS = ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh")
_GPT2 = FieldPolicy(
    implemented=frozenset({"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                           "layer_norm_epsilon", "tie_word_embeddings"}),
    # dropouts are training-only; summary_*: GPT2DoubleHeadsModel's multiple-choice head; n_ctx:
    # older configs' copy of n_positions, which transformers no longer reads
    ignored=frozenset({"resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj",
                       "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "n_ctx"}),
    restricted={"activation_function": _GPT_GELUS, "scale_attn_weights": (True,),
                "scale_attn_by_inverse_layer_idx": (False,), "reorder_and_upcast_attn": (False,)},
    rope_types=(),
    defaults={"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
    aliases=_GPT_ALIASES,
)
_GPT_BIGCODE = FieldPolicy(
    # (transformers 5 writes num_key_value_heads beside multi_query; the model checks they agree)
    implemented=_GPT2.implemented | {"multi_query", "num_key_value_heads"},
    # softmax in fp32: ours always is
    ignored=frozenset({"resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_softmax_in_fp32",
                       "scale_attention_softmax_in_fp32", "n_ctx"}),
    restricted={"activation_function": _GPT_GELUS, "scale_attn_weights": (True,)},
    rope_types=(),
    defaults={"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
              "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
              "multi_query": True},
    aliases=_GPT_ALIASES,
)

_BLOOM = FieldPolicy(
    implemented=frozenset({"vocab_size", "hidden_size", "n_embed", "n_layer", "n_head", "layer_norm_epsilon",
                           "tie_word_embeddings"}),
    # dropouts are training-only; the rest are Megatron-DeepSpeed's training switches that
    # bigscience's configs carry and transformers never reads (n_inner included: the MLP is 4x wide)
    ignored=frozenset({"hidden_dropout", "slow_but_exact", "attention_softmax_in_fp32", "bias_dropout_fusion",
                       "masked_softmax_fusion", "offset_alibi", "skip_bias_add", "skip_bias_add_qkv",
                       "unk_token_id", "seq_length", "n_inner"}),
    restricted={"apply_residual_connection_post_layernorm": (False,)},
    rope_types=(),
    defaults={"vocab_size": 250880, "hidden_size": 64, "n_layer": 2, "n_head": 8, "layer_norm_epsilon": 1e-5,
              "tie_word_embeddings": True},
    aliases={"hidden_size": "n_embed", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
)

_FALCON = FieldPolicy(
    implemented=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "n_layer",
                           "n_head", "num_kv_heads", "num_ln_in_parallel_attn", "layer_norm_epsilon",
                           "new_decoder_architecture", "multi_query", "parallel_attn", "bias",
                           "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
                           "ffn_hidden_size", "tie_word_embeddings",
                           # (transformers >= 5.25 writes the heads its layout gives; checked against it)
                           "num_key_value_heads"}),
    ignored=frozenset({"hidden_dropout"}),  # training-only
    # ALiBi Falcons (falcon-rw) scale their biases with the scores: not implemented
    restricted={"alibi": (False,), "activation": _GPT_GELUS, "apply_residual_connection_post_layernorm": (False,)},
    rope_types=("default", "linear"),
    defaults={"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
              "layer_norm_epsilon": 1e-5, "new_decoder_architecture": False, "multi_query": True,
              "parallel_attn": True, "bias": False, "activation": "gelu", "tie_word_embeddings": True,
              "max_position_embeddings": 2048},
    aliases={"num_hidden_layers": "n_layer", "num_attention_heads": "n_head", "intermediate_size": "ffn_hidden_size",
             "hidden_act": "activation"},
)

_MPT = FieldPolicy(
    # attn_config's keys are checked by the model (models/mpt.py)
    implemented=frozenset({"vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len", "layer_norm_epsilon",
                           "attn_config", "tie_word_embeddings"}),
    # dropouts, init and logging are training-only; transformers' MPT has no position embeddings
    # whatever learned_pos_emb says (ALiBi); tokenizer_name names the tokenizer MosaicML trained with
    ignored=frozenset({"resid_pdrop", "emb_pdrop", "init_device", "init_config", "verbose", "embedding_fraction",
                       "learned_pos_emb", "tokenizer_name"}),
    restricted={"expansion_ratio": (4,), "no_bias": (True,), "logit_scale": (None,),
                "norm_type": ("low_precision_layernorm", "layernorm")},
    rope_types=(),
    defaults={"d_model": 2048, "n_heads": 16, "n_layers": 24, "max_seq_len": 2048, "vocab_size": 50368,
              "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
    aliases={"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
             "max_position_embeddings": "max_seq_len"},
)

_OLMO = FieldPolicy(
    # (rms_norm_eps: OLMo's norms are LayerNorms with a fixed eps; the key is not OLMo's)
    implemented=DENSE_IMPLEMENTED - {"rms_norm_eps"} | {"attention_bias", "clip_qkv"},
    restricted={"hidden_act": ("silu",)},
    defaults={"max_position_embeddings": 2048, "vocab_size": 50304},
)

_GPTJ = FieldPolicy(
    implemented=frozenset({"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "rotary_dim",
                           "layer_norm_epsilon", "tie_word_embeddings"}),
    ignored=frozenset({"resid_pdrop", "embd_pdrop", "attn_pdrop"}),  # training-only
    restricted={"activation_function": _GPT_GELUS},
    rope_types=(),
    defaults={"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
              "rotary_dim": 64, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "tie_word_embeddings": False},
    aliases=_GPT_ALIASES,
)

_QWEN2_MOE = FieldPolicy(
    implemented=DENSE_IMPLEMENTED | {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                     "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                     "mlp_only_layers", "qkv_bias", "layer_types"},
    # (the window settings are read only with use_sliding_window, which is refused)
    ignored=frozenset({"sliding_window", "max_window_layers"}),
    restricted={"hidden_act": ("silu",), "use_sliding_window": (False,)},
    defaults={"max_position_embeddings": 32768, "num_experts": 60, "num_experts_per_tok": 4,
              "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
              "decoder_sparse_step": 1, "vocab_size": 151936, "rms_norm_eps": 1e-6},
)

POLICIES: Mapping[str, FieldPolicy] = {
    "BloomForCausalLM": _BLOOM,
    "Qwen2MoeForCausalLM": _QWEN2_MOE,
    "GPTJForCausalLM": _GPTJ,
    "OlmoForCausalLM": _OLMO,
    "MptForCausalLM": _MPT,
    "MPTForCausalLM": _MPT,  # (MosaicML's own configs name its custom class)
    "FalconForCausalLM": _FALCON,
    "GPT2LMHeadModel": _GPT2,
    "GPTBigCodeForCausalLM": _GPT_BIGCODE,
    "GPTNeoXForCausalLM": _GPT_NEOX,
    "StableLmForCausalLM": _STABLELM,
    "PhiForCausalLM": _PHI,
    "OPTForCausalLM": _OPT,
    "Olmo2ForCausalLM": _OLMO2,
    "Phi3ForCausalLM": _PHI3,
    "GemmaForCausalLM": _GEMMA,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "GraniteForCausalLM": _GRANITE,
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _MISTRAL,
    "MixtralForCausalLM": _MIXTRAL,
    "Qwen2ForCausalLM": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "SmolLM3ForCausalLM": _SMOLLM3,
    "Starcoder2ForCausalLM": _STARCODER2,
}


def implementing_architecture(architecture: str) -> str:
    """The implementation a checkpoint's architecture runs on: a `*Model` (the decoder without
    its language-model head, as embedding models ship it) and a `*ForSequenceClassification`
    (the decoder with a classification head, `score`) on its `*ForCausalLM`."""
    for suffix in ("Model", "ForSequenceClassification"):
        if architecture.endswith(suffix):
            causal = architecture.removesuffix(suffix) + "ForCausalLM"
            if causal in POLICIES:
                return causal
    return architecture


def _falcon_kv_layout(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Falcon's key / value heads as transformers builds them (models/falcon.py's table), and its
    norms: two in the new decoder architecture unless it says one."""
    heads, new_architecture = cfg["num_attention_heads"], cfg["new_decoder_architecture"]
    if new_architecture:
        kv_heads = cfg.get("num_kv_heads") or heads
    else:
        kv_heads = 1 if cfg["multi_query"] else heads
    norms = cfg.get("num_ln_in_parallel_attn") or (2 if new_architecture else 1)
    return {"num_key_value_heads": kv_heads, "num_ln_in_parallel_attn": norms}


def _check_falcon_kv_heads(cfg: Mapping[str, Any]) -> None:
    """Falcon's KV heads follow from its layout fields (transformers recomputes the
    num_key_value_heads it writes); a config that says otherwise is refused, not overruled."""
    derived = with_defaults("FalconForCausalLM", cfg)["num_key_value_heads"]
    if cfg["num_key_value_heads"] != derived:
        raise ValueError(f"config.json: num_key_value_heads={cfg['num_key_value_heads']!r} contradicts Falcon's "
                         f"layout (new_decoder_architecture, multi_query and num_kv_heads give {derived}); "
                         "refusing to load rather than pick one")


def check_config_fields(architecture: str, cfg: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first field of `cfg` that `architecture` neither implements,
    ignores, nor accepts at its present value."""
    policy = POLICIES.get(architecture)
    if policy is None:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(POLICIES))}")
    restricted = {**COMMON_RESTRICTED, **policy.restricted}
    for name, value in cfg.items():
        if name == "quantization_config" and value is not None:
            check_quantization_config(value)
        elif name in restricted:
            if value not in restricted[name]:
                raise ValueError(f"config.json: {name}={value!r} is not supported for {architecture} "
                                 f"(supported: {_describe(restricted[name])})")
        elif name not in policy.implemented and name not in policy.ignored and name not in COMMON_IGNORED:
            raise ValueError(f"config.json: field {name!r} is not implemented for {architecture}; "
                             "refusing to load rather than ignore it")
    if architecture == "FalconForCausalLM" and "num_key_value_heads" in cfg:
        _check_falcon_kv_heads(cfg)
    for name in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(name)
        if isinstance(rope, Mapping) and set(rope) <= set(SLIDING_LAYER_TYPES):  # one per layer type
            for layer_type, sub in rope.items():
                check_rope_fields(architecture, f"{name}.{layer_type}", sub, policy.rope_types)
        elif isinstance(rope, Mapping):
            check_rope_fields(architecture, name, rope, policy.rope_types, policy.partial_rotary)
    for layer_type in cfg.get("layer_types") or ():
        if layer_type not in SLIDING_LAYER_TYPES:
            raise ValueError(f"config.json: layer_types entry {layer_type!r} is not supported for "
                             f"{architecture} (supported: {', '.join(SLIDING_LAYER_TYPES)})")


def rope_type_of(rope: Mapping[str, Any]) -> str:
    """A rope dict's type: `rope_type`, or older configs' `type`; neither is plain rope."""
    return rope.get("rope_type", rope.get("type", "default"))


def check_rope_fields(architecture: str, name: str, rope: Mapping[str, Any],
                      rope_types: tuple[str, ...], partial_rotary: bool = False) -> None:
    rope_type = rope_type_of(rope)
    if rope_type not in rope_types or rope_type not in ROPE_KEYS_BY_TYPE:
        raise ValueError(f"config.json: {name} rope_type {rope_type!r} is not supported for "
                         f"{architecture} (supported: {', '.join(rope_types)})")
    missing = sorted(ROPE_REQUIRED_KEYS.get(rope_type, frozenset()) - set(rope))
    if missing:
        raise ValueError(f"config.json: {name} with rope_type {rope_type!r} lacks {', '.join(missing)}")
    known = ROPE_KEYS_IGNORED | ROPE_KEYS_BY_TYPE[rope_type]
    for key, value in rope.items():
        if key == "partial_rotary_factor" and (value == 1.0 or partial_rotary):
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"config.json: {name}.partial_rotary_factor must be in (0, 1], got {value!r}")
            continue
        if key not in known:
            raise ValueError(f"config.json: {name}.{key}={value!r} is not implemented for "
                             f"{architecture} with rope_type {rope_type!r}")


def _describe(values: tuple[Any, ...]) -> str:
    return ", ".join("absent" if v is None else repr(v) for v in values)


def with_defaults(architecture: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' defaults filled in for the fields it leaves out, and the generic
    names of the fields its family names its own way."""
    policy = POLICIES.get(architecture)
    full = {**(policy.defaults if policy else {}), **cfg}
    for generic, own in (policy.aliases if policy else {}).items():
        if full.get(own) is not None:
            full.setdefault(generic, full[own])
    if architecture in ("GPT2LMHeadModel", "GPTBigCodeForCausalLM", "BloomForCausalLM", "FalconForCausalLM",
                        "MptForCausalLM", "MPTForCausalLM", "GPTJForCausalLM"):
        full.setdefault("intermediate_size", 4 * full["hidden_size"])  # (n_inner null; Bloom's always 4x)
    if architecture == "FalconForCausalLM":
        full.update(_falcon_kv_layout(full))
    if architecture in ("GPT2LMHeadModel", "GPTBigCodeForCausalLM"):
        full.setdefault("num_key_value_heads", 1 if full.get("multi_query") else full["num_attention_heads"])
    return full


def gemma_layer_types(cfg: Mapping[str, Any], architecture: str) -> list[str]:
    """`layer_types`, or transformers' default: Gemma (1) has only global layers; Gemma 2
    alternates local/global from a local layer; Gemma 3 makes every `sliding_window_pattern`-th
    layer global."""
    num_layers = cfg["num_hidden_layers"]
    if architecture == "GemmaForCausalLM":
        return ["full_attention"] * num_layers
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if architecture == "Gemma2ForCausalLM":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def resolve_model_impl(model_impl: str, architecture: str) -> str:
    """"vllm" (a native implementation) or "transformers" (the fallback)."""
    if model_impl == "vllm" and architecture not in POLICIES:
        raise ValueError(f"architecture {architecture!r} has no native implementation (native: "
                         f"{', '.join(sorted(POLICIES))}); model_impl='auto' or 'transformers' runs "
                         "it through transformers' modelling code")
    if model_impl == "auto":
        return "vllm" if architecture in POLICIES else "transformers"
    return model_impl


# What the fallback's attention cannot honour although transformers' model would: chunked local
# attention (Llama 4's), which transformers builds into the attention mask the fallback replaces.
FALLBACK_RESTRICTED: Mapping[str, tuple[Any, ...]] = {"attention_chunk_size": (None,)}


def check_fallback_fields(architecture: str, cfg: Mapping[str, Any]) -> None:
    """What the Transformers fallback cannot honour: transformers runs the model's own maths, so
    only what bypasses it is refused (custom code, quantized weights, encoder-decoders, attention
    patterns made by the mask). gpt-oss's MXFP4 experts are the one quantization it loads
    (transformers dequantizes them)."""
    quantization = cfg.get("quantization_config")
    if isinstance(quantization, Mapping) and quantization.get("quant_method") == "mxfp4":
        check_quantization_config(quantization)
        if cfg.get("model_type") != "gpt_oss":
            raise ValueError(f"config.json: quantization_config.quant_method='mxfp4' is gpt-oss's (its experts); "
                             f"transformers does not load it for model_type {cfg.get('model_type')!r}")
        cfg = {name: value for name, value in cfg.items() if name != "quantization_config"}
    for name, allowed in {**COMMON_RESTRICTED, **FALLBACK_RESTRICTED}.items():
        if name in cfg and cfg[name] not in allowed:
            raise ValueError(f"config.json: {name}={cfg.get(name)!r} is not supported "
                             f"(supported: {_describe(allowed)})")
    if not architecture.endswith("ForCausalLM"):
        raise ValueError(f"architecture {architecture!r} is not a decoder-only *ForCausalLM model")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = cfg.get("model_type")
    built = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if built is None and cfg.get("auto_map"):
        raise ValueError(f"architecture {architecture!r} exists only as custom code in its repository "
                         "(config.json auto_map: a trust_remote_code model); vllm_lite never runs code "
                         "from a model repository")
    if built != architecture:
        raise ValueError(f"architecture {architecture!r} (model_type {model_type!r}) is not supported: "
                         f"no native implementation (supported: {', '.join(sorted(POLICIES))}) and "
                         f"transformers builds {built or 'no causal-LM class'} for that model_type")


def with_transformers_names(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A fallback model's config with the generic names its transformers config class maps onto
    its own (`attribute_map`: GPT-J's n_head is num_attention_heads, MPT's d_model hidden_size,
    ...), as transformers reads them."""
    from transformers import AutoConfig

    attribute_map = getattr(type(AutoConfig.for_model(cfg["model_type"])), "attribute_map", {})
    full = dict(cfg)
    for generic, own in attribute_map.items():
        if isinstance(own, str) and own in cfg:
            full.setdefault(generic, cfg[own])
    return full


def fallback_cache_shape(cfg: Mapping[str, Any]) -> dict[str, int]:
    """The paged KV cache's heads and head width for a fallback model whose config's own
    num_key_value_heads / head_dim do not describe every layer's keys and values ({} where they
    do). Not written back into the config transformers builds the model from."""
    if cfg.get("kv_lora_rank") is not None:
        return latent_attention_cache_shape(cfg)
    if cfg.get("per_layer_config"):
        return per_layer_cache_shape(cfg)
    return {}


def per_layer_cache_shape(cfg: Mapping[str, Any]) -> dict[str, int]:
    """Attention shapes that differ by layer (transformers' `per_layer_config`: Gemma 4's global
    layers, of a wider head_dim and their own KV head count) through the fallback: the paged KV
    cache holds every layer at the widest head and the most KV heads; the fallback pads a narrower
    layer's heads with zeros and repeats a layer's fewer KV heads for the query heads that share
    them, which leave its scores and output unchanged. Memory: every layer at the widest shape."""
    layers = [cfg, *({**cfg, **overrides} for overrides in cfg["per_layer_config"].values())]
    head_dims = [layer.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"] for layer in layers]
    kv_heads = [layer.get("num_key_value_heads") or cfg["num_attention_heads"] for layer in layers]
    most_kv_heads = max(kv_heads)
    if any(most_kv_heads % heads or layer["num_attention_heads"] % most_kv_heads
           for heads, layer in zip(kv_heads, layers)):
        raise ValueError(f"config.json: per_layer_config's KV heads {sorted(set(kv_heads))} do not divide each "
                         "other and the query heads, so one paged KV cache cannot hold every layer")
    return {"head_dim": max(head_dims), "num_key_value_heads": most_kv_heads}


def latent_attention_cache_shape(cfg: Mapping[str, Any]) -> dict[str, int]:
    """Multi-head latent attention (DeepSeek-V2 / V3, Moonlight, Kimi) through the fallback: the
    paged KV cache holds each head's whole key (qk_nope_head_dim + qk_rope_head_dim dimensions) and
    value (v_head_dim), in one head width, the wider of the two (the fallback pads the narrower
    with zeros, which leave the scores and the output unchanged). vLLM caches the compressed
    latent instead: this takes several times the memory per token."""
    key_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return {"num_key_value_heads": cfg["num_attention_heads"], "head_dim": max(key_dim, cfg["v_head_dim"])}



# A checkpoint's `quantization_config` this engine loads. compressed-tensors' W8A8 int8 (vLLM's
# CompressedTensorsW8A8Int8 with dynamic per-token activations), run by the int8 linear layers
# that quantization="int8" uses. Every key is classified as everywhere else: one that changes the
# math is accepted at the listed values only, metadata is ignored, an unknown key is refused.
CT_TOP_RESTRICTED: Mapping[str, tuple[Any, ...]] = {
    # int8 W8A8, fp8, or packed W4A16 / W8A16 tensors in the file (naive / sparse formats are not)
    "format": ("int-quantized", "float-quantized", "pack-quantized"),
    "quantization_status": ("compressed",),
    "kv_cache_scheme": (None,),
    "sparsity_config": (None, {}),
    "transform_config": (None, {}),
}
CT_TOP_IGNORED = frozenset({"quant_method", "config_groups", "ignore", "global_compression_ratio", "version",
                            "provider"})
CT_WEIGHTS: Mapping[str, tuple[Any, ...]] = {
    "num_bits": (8,), "type": ("int",), "symmetric": (True,), "strategy": ("channel", "tensor"),
    "dynamic": (False,), "group_size": (None,), "block_structure": (None,), "actorder": (None, False),
}
CT_INPUTS: Mapping[str, tuple[Any, ...]] = {
    "num_bits": (8,), "type": ("int",), "symmetric": (True,), "strategy": ("token",),
    "dynamic": (True,), "group_size": (None,), "block_structure": (None,), "actorder": (None, False),
}
# compressed-tensors' FP8 (float-quantized): e4m3 weights per tensor, channel or block, read into
# float weights at load (model/layers/fp8_weights.py); activations, whatever the scheme says, stay
# in the model dtype (vLLM's weight-only FP8 where the hardware has no FP8 matmul).
CT_WEIGHTS_FP8: Mapping[str, tuple[Any, ...]] = {
    "num_bits": (8,), "type": ("float",), "symmetric": (True,), "strategy": ("tensor", "channel", "block"),
    "dynamic": (False,), "group_size": (None,), "actorder": (None, False),
}
CT_INPUTS_FP8: Mapping[str, tuple[Any, ...]] = {
    "num_bits": (8,), "type": ("float",), "symmetric": (True,), "strategy": ("token", "tensor", "group"),
    "dynamic": (True, False), "block_structure": (None,), "actorder": (None, False),
}
CT_FP8_ARGS_IGNORED = frozenset({"block_structure", "group_size"})  # (checked with the strategy)
# compressed-tensors' pack-quantized W4A16 / W8A16 (GPTQ-like integers packed in int32, read by
# model/layers/wna16.py as AWQ and GPTQ are): activations unquantized.
CT_WEIGHTS_PACKED: Mapping[str, tuple[Any, ...]] = {
    "num_bits": (4, 8), "type": ("int",), "symmetric": (True, False), "strategy": ("group", "channel"),
    "dynamic": (False,), "block_structure": (None,), "actorder": (None, False, "group", "weight", "static"),
}
CT_ARGS_IGNORED = frozenset({"observer", "observer_kwargs", "scale_dtype", "zp_dtype"})  # calibration, storage
CT_GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})

# AWQ (AutoAWQ's GEMM packing) and GPTQ (AutoGPTQ / GPTQModel) 4-bit checkpoints, W4A16: their
# weights are dequantized at load (model/layers/wna16.py). The math-changing keys are restricted;
# the quantizer's own settings (calibration, kernels, fusing) are ignored.
# How the quantizer ran (calibration data, damping, kernels, batch sizes, fusing): no effect on the
# stored weights' meaning. transformers 5 writes these for AWQ too (its AwqConfig is a GPTQConfig).
QUANTIZER_SETTINGS = frozenset({
    "quant_method", "group_size", "desc_act", "static_groups", "damp_percent", "damp_auto_increment",
    "true_sequential", "act_group_aware", "model_name_or_path", "model_file_base_name", "dataset", "tokenizer",
    "use_exllama", "max_input_length", "exllama_config", "cache_block_outputs", "modules_in_block_to_quantize",
    "batch_size", "pad_token_id", "use_cuda_fp16", "module_name_preceding_first_block", "block_name_to_quantize",
    "backend", "meta", "mse", "quantizer", "is_marlin_format", "use_marlin", "model_seqlen", "disable_exllama"})
AWQ_RESTRICTED: Mapping[str, tuple[Any, ...]] = {
    "bits": (4,), "zero_point": (True,), "version": ("gemm", "GEMM"), "format": ("gemm", "GEMM"),
}
# (`sym`: transformers 5 writes True beside zero_point; AWQ's GEMM format always stores its zeros)
AWQ_IGNORED = QUANTIZER_SETTINGS | {"modules_to_not_convert", "do_fuse", "fuse_max_seq_len", "modules_to_fuse",
                                    "sym"}
GPTQ_RESTRICTED: Mapping[str, tuple[Any, ...]] = {
    "bits": (4, 8), "sym": (True, False), "checkpoint_format": ("gptq", "gptq_v2"), "format": ("gptq", "gptq_v2"),
    "lm_head": (False,), "pack_dtype": ("int32",),
    "dynamic": (None, {}),  # GPTQModel's per-module overrides of bits / group size
}
GPTQ_IGNORED = QUANTIZER_SETTINGS
# quant_method "fp8" (vLLM's offline FP8, transformers' FineGrainedFP8, the FP8 releases of Qwen
# and DeepSeek): e4m3 weights with a per-tensor `weight_scale` or `weight_scale_inv` blocks of
# weight_block_size; read into float weights as compressed-tensors' FP8 is.
FP8_RESTRICTED: Mapping[str, tuple[Any, ...]] = {"activation_scheme": ("dynamic", "static"), "fmt": ("e4m3",)}
FP8_IGNORED = frozenset({"quant_method", "ignored_layers", "modules_to_not_convert", "weight_block_size"})
# quant_method "bitsandbytes" (transformers' BitsAndBytesConfig): 4-bit NF4 / FP4 weights, double
# quantization or not, read into float weights (model/layers/bnb_weights.py). LLM.int8 checkpoints
# (load_in_8bit) are refused: bitsandbytes multiplies their activations in int8 with fp16 outliers,
# which float weights do not reproduce. The compute dtype is the engine's dtype's role here; the
# skipped modules are stored unquantized (their tensors say so); the llm_int8_* settings are 8-bit's.
BNB_RESTRICTED: Mapping[str, tuple[Any, ...]] = {
    "load_in_4bit": (True,), "_load_in_4bit": (True,), "load_in_8bit": (False,), "_load_in_8bit": (False,),
    "bnb_4bit_quant_type": ("nf4", "fp4"), "bnb_4bit_quant_storage": ("uint8", None),
    "bnb_4bit_use_double_quant": (True, False),
}
BNB_IGNORED = frozenset({"quant_method", "bnb_4bit_compute_dtype", "llm_int8_skip_modules", "llm_int8_threshold",
                         "llm_int8_has_fp16_weight", "llm_int8_enable_fp32_cpu_offload"})
CHECKPOINT_QUANTIZATIONS = ("compressed-tensors", "awq", "gptq", "fp8", "mxfp4", "bitsandbytes")
# gpt-oss's released checkpoints: its MoE experts in MXFP4 (e2m1 values, an e8m0 scale per 32);
# `modules_to_not_convert` lists what the checkpoint keeps in bf16 (transformers reads it).
MXFP4_IGNORED = frozenset({"quant_method", "modules_to_not_convert"})


def check_quantization_config(config: Any) -> str:
    """The quantization method a checkpoint's `quantization_config` needs (one of
    CHECKPOINT_QUANTIZATIONS), or ValueError naming the first key (as config.json's path) this
    engine does not run."""
    where = "config.json: quantization_config"
    if not isinstance(config, Mapping):
        raise ValueError(f"{where} must be a mapping, got {config!r}")
    method = config.get("quant_method")
    if method == "awq":
        _check_keys(where, config, AWQ_RESTRICTED, AWQ_IGNORED)
        _check_group_size(where, config.get("group_size"))
        return method
    if method == "gptq":
        _check_keys(where, config, GPTQ_RESTRICTED, GPTQ_IGNORED)
        _check_group_size(where, config.get("group_size"))
        return method
    if method == "mxfp4":
        _check_keys(where, config, {}, MXFP4_IGNORED)
        return method
    if method == "bitsandbytes":
        if config.get("load_in_8bit") or config.get("_load_in_8bit"):
            raise ValueError(f"{where}: load_in_8bit (bitsandbytes' LLM.int8: activations multiplied in int8 with "
                             "fp16 outliers) is not implemented here; 4-bit bitsandbytes checkpoints are")
        _check_keys(where, config, BNB_RESTRICTED, BNB_IGNORED)
        if not (config.get("load_in_4bit") or config.get("_load_in_4bit")):
            raise ValueError(f"{where}: a bitsandbytes checkpoint here is a 4-bit one (load_in_4bit: true)")
        return method
    if method == "fp8":
        _check_keys(where, config, FP8_RESTRICTED, FP8_IGNORED)
        _check_block(f"{where}.weight_block_size", config.get("weight_block_size"))
        return method
    if method != "compressed-tensors":
        raise ValueError(f"{where}.quant_method={method!r} is not supported (supported: compressed-tensors W8A8 "
                         "int8 and FP8, fp8, AWQ, GPTQ, bitsandbytes 4-bit, gpt-oss's mxfp4)")
    _check_keys(where, config, CT_TOP_RESTRICTED, CT_TOP_IGNORED)
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}.config_groups must name at least one group, got {groups!r}")
    for name, group in groups.items():
        _check_group(f"{where}.config_groups.{name}", group, config.get("format"))
    types = {compressed_tensors_type(group) for group in groups.values()}
    if len(types) > 1 or types != {"float" if config.get("format") == "float-quantized" else "int"}:
        raise ValueError(f"{where}: format {config.get('format')!r} and the groups' weight types {sorted(types)} "
                         "must agree (int-quantized and pack-quantized: int groups; float-quantized: fp8 groups)")
    schemes = {(g["weights"].get("num_bits"), g["weights"].get("symmetric", True)) for g in groups.values()}
    if config.get("format") == "pack-quantized" and len(schemes) > 1:
        raise ValueError(f"{where}: pack-quantized groups must share one num_bits and symmetric, got {sorted(schemes)}")
    return method


def compressed_tensors_type(group: Mapping[str, Any]) -> str:
    """A compressed-tensors group's weight type: "int" (W8A8 int8) or "float" (FP8)."""
    return group["weights"].get("type", "int")


def _check_block(where: str, block: Any) -> None:
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where} must be two positive integers (rows, columns) or absent, got {block!r}")


def _check_group_size(where: str, group_size: Any) -> None:
    if not (isinstance(group_size, int) and (group_size > 0 or group_size == -1)):
        raise ValueError(f"{where}.group_size must be a positive integer or -1 (one group a row), got "
                         f"{group_size!r}")


def _check_group(where: str, group: Any, top_format: Any) -> None:
    if not isinstance(group, Mapping):
        raise ValueError(f"{where} must be a mapping, got {group!r}")
    unknown = sorted(set(group) - CT_GROUP_KEYS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not implemented; refusing to load rather than ignore it")
    if group.get("format") not in (None, top_format):
        raise ValueError(f"{where}.format={group['format']!r} is not supported (a group's format must be the "
                         f"checkpoint's, {top_format!r})")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations is not supported (output quantization)")
    weights = group.get("weights")
    if isinstance(weights, Mapping) and weights.get("type") == "float":
        _check_fp8_group(where, group)
        return
    if top_format == "pack-quantized":
        _check_packed_group(where, group)
        return
    for key, restricted in (("weights", CT_WEIGHTS), ("input_activations", CT_INPUTS)):
        args = group.get(key)
        if not isinstance(args, Mapping):
            raise ValueError(f"{where}.{key} is {args!r}: int8 is supported as W8A8 only (weights and input "
                             "activations both quantized)")
        _check_keys(f"{where}.{key}", args, restricted, CT_ARGS_IGNORED)


def _check_packed_group(where: str, group: Mapping[str, Any]) -> None:
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise ValueError(f"{where}.weights must be a mapping, got {weights!r}")
    _check_keys(f"{where}.weights", weights, CT_WEIGHTS_PACKED, CT_ARGS_IGNORED | {"group_size"})
    if weights.get("strategy") == "group":
        _check_group_size(f"{where}.weights", weights.get("group_size"))
    if group.get("input_activations") is not None:
        raise ValueError(f"{where}.input_activations is not supported with pack-quantized weights (W4A16 / W8A16 "
                         "only: activations unquantized)")


def _check_fp8_group(where: str, group: Mapping[str, Any]) -> None:
    weights = group["weights"]
    _check_keys(f"{where}.weights", weights, CT_WEIGHTS_FP8, CT_ARGS_IGNORED | CT_FP8_ARGS_IGNORED)
    block = weights.get("block_structure")
    if (weights.get("strategy") == "block") != (block is not None):
        raise ValueError(f"{where}.weights.block_structure={block!r} does not fit strategy "
                         f"{weights.get('strategy')!r} (a block strategy needs one, others none)")
    _check_block(f"{where}.weights.block_structure", block)
    inputs = group.get("input_activations")
    if inputs is not None:  # (W8A16 FP8 has none; the activations stay in the model dtype either way)
        if not isinstance(inputs, Mapping):
            raise ValueError(f"{where}.input_activations must be a mapping or null, got {inputs!r}")
        _check_keys(f"{where}.input_activations", inputs, CT_INPUTS_FP8, CT_ARGS_IGNORED | CT_FP8_ARGS_IGNORED)


def _check_keys(where: str, mapping: Mapping[str, Any], restricted: Mapping[str, tuple[Any, ...]],
                ignored: frozenset[str]) -> None:
    for key, value in mapping.items():
        if key in restricted:
            if value not in restricted[key]:
                raise ValueError(f"{where}.{key}={value!r} is not supported (supported: "
                                 f"{', '.join(repr(v) for v in restricted[key])})")
        elif key not in ignored:
            raise ValueError(f"{where}.{key} is not implemented; refusing to load rather than ignore it")
