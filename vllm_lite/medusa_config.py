"""A Medusa head's config.json (vLLM's speculative method "medusa"): k heads, each a stack of
residual SiLU blocks over the model's last hidden state and an LM head, head i drafting the token
i + 1 places after the model's next one (top-1 each, as vLLM drafts; Medusa's tree is not used).
Read in vLLM's converted form (`MedusaModel`: num_heads, num_hidden_layers) and FasterDecoding's
(`medusa_num_heads`, `medusa_num_layers`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_INFORMATIONAL = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
                  "base_model_name_or_path", "_name_or_path",
                  # Medusa's tree search settings: vLLM drafts the top token of each head and reads neither
                  "max_paths", "topk", "max_seq_len")
_READ = ("hidden_size", "vocab_size", "num_heads", "medusa_num_heads", "num_hidden_layers", "medusa_num_layers",
         "truncated_vocab_size", "original_lm_head", "medusa_fc_bias", "logit_scale")


@dataclass(frozen=True, slots=True)
class MedusaHeadConfig:
    num_heads: int
    num_layers: int  # residual blocks per head
    hidden_size: int
    vocab_size: int
    fc_bias: bool  # the blocks' linear layers have biases (medusa_fc_bias)
    shared_lm_head: bool  # one LM head for every head (original_lm_head)


def read_medusa_head(raw: dict[str, Any], target_hidden: int, target_vocab: int) -> MedusaHeadConfig:
    """The head's settings, checked against the model; ValueError naming what does not fit or is
    not implemented."""
    unknown = sorted(set(raw) - set(_INFORMATIONAL) - set(_READ))
    if unknown:
        raise ValueError(f"speculative_config: the Medusa head's config.json field(s) {', '.join(map(repr, unknown))} "
                         "not implemented")
    architectures = raw.get("architectures") or ["MedusaModel"]
    if architectures[0] != "MedusaModel":
        raise ValueError(f"speculative_config: method='medusa' takes a Medusa head (MedusaModel); its config.json "
                         f"says architectures={architectures!r}")
    num_heads = raw.get("num_heads", raw.get("medusa_num_heads"))
    num_layers = raw.get("num_hidden_layers", raw.get("medusa_num_layers", 1))
    for name, value in (("num_heads", num_heads), ("num_hidden_layers", num_layers)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"speculative_config: the Medusa head's {name} must be an integer >= 1, got {value!r}")
    hidden = raw.get("hidden_size", target_hidden)
    vocab = raw.get("vocab_size", target_vocab)
    if hidden != target_hidden or vocab != target_vocab:
        raise ValueError(f"speculative_config: the Medusa head (hidden_size={hidden}, vocab_size={vocab}) does not "
                         f"fit the model (hidden_size={target_hidden}, vocab_size={target_vocab})")
    if raw.get("truncated_vocab_size", vocab) != vocab:
        raise ValueError("speculative_config: a Medusa head's truncated_vocab_size (a token_map's smaller draft "
                         "vocabulary) is not implemented")
    scale = raw.get("logit_scale", 1.0)
    if not (isinstance(scale, (int, float)) and scale > 0):  # (a positive scale keeps each head's top token)
        raise ValueError(f"speculative_config: the Medusa head's logit_scale must be a positive number, got {scale!r}")
    return MedusaHeadConfig(num_heads, num_layers, hidden, vocab, bool(raw.get("medusa_fc_bias", False)),
                            bool(raw.get("original_lm_head", False)))
