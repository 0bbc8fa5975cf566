"""An EAGLE head's config.json (vLLM's speculative methods "eagle" and "eagle3"): the fields that
describe the head itself, read apart from the Llama decoder-layer fields the rest of the file
holds (those go through the Llama architecture's field policy, as any Llama config does).

EAGLE-1 (SafeAILab's EAGLE, vLLM's `EagleLlamaForCausalLM`): `fc` maps [token embedding, the
model's last hidden state] to the head's width, Llama layers follow (the first without its input
norm), and the model's own LM head gives the draft logits. EAGLE-3 (`Eagle3LlamaForCausalLM`):
`fc` maps the model's residual stream at three layers (`eagle_aux_hidden_state_layer_ids`) to the
head's width, the first layer attends over [normed embedding, normed hidden] (twice the width),
and the head has its own final norm and LM head, over a smaller draft vocabulary mapped back to
the model's by `d2t` offsets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EAGLE_METHODS = ("eagle", "eagle3")
# config.json architectures an EAGLE head is saved under (vLLM's names and SafeAILab's)
EAGLE_HEAD_ARCHITECTURES = {
    "eagle": ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle"),
    "eagle3": ("LlamaForCausalLM", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3Qwen3ForCausalLM"),
}
# heads whose layers are Qwen3's (per-head RMSNorm on q and k; vLLM's Eagle3Qwen3ForCausalLM)
_QWEN3_HEADS = ("Eagle3Qwen3ForCausalLM",)
# Models whose layers keep the residual apart from the layer output as vLLM's Llama does (our
# LlamaModel): where EAGLE-3 reads the residual stream; EAGLE-1 heads were trained on these too.
EAGLE_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                              "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# EAGLE-3 fields vLLM reads, beside `eagle_config`'s
_EAGLE3_FLAGS = ("norm_before_residual", "norm_output", "fc_norm", "norm_before_fc")
_EAGLE3_FIELDS = (*_EAGLE3_FLAGS, "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states",
                  "eagle_aux_hidden_state_layer_ids", "eagle_config")
_EAGLE_CONFIG_KEYS = ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc")


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    """`aux_layer_ids`: EAGLE-3's model layers whose input (the residual stream: layer i's input,
    the last layer's output for i = num_hidden_layers) the head reads, concatenated in this order;
    empty where the head reads the model's final (normed) hidden state: EAGLE-1, and EAGLE-3
    with `use_aux_hidden_state` false (then without `fc`)."""

    version: int  # 1 or 3
    aux_layer_ids: tuple[int, ...]
    draft_vocab_size: int  # EAGLE-3's LM head rows (the model's vocabulary unless smaller)
    target_hidden_size: int  # the model's hidden width (what `fc` reads, per aux layer)
    norm_before_residual: bool = False  # EAGLE-3's first layer: the hidden norm before the residual is taken
    norm_output: bool = False  # EAGLE-3: the next draft pass reads the normed output, not the pre-norm one
    fc_norm: bool = False  # EAGLE-3: each aux layer's states normed before `fc`
    norm_before_fc: bool = False  # EAGLE-3: the concatenated aux states normed before `fc`
    qk_norm: bool = False  # the layers norm q and k per head (a Qwen3 head)


def eagle_method_of(model: str) -> str | None:
    """vLLM's inference of the method from a draft's name when none is given: "eagle-" in it is
    EAGLE-1 (yuhuili/EAGLE-LLaMA3-Instruct-8B), "eagle3" EAGLE-3; None: a draft model."""
    name = model.lower()
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    return None


def read_eagle_head(raw: dict[str, Any], method: str, target_layers: int, target_hidden: int,
                    target_vocab: int) -> tuple[EagleHeadConfig, dict[str, Any]]:
    """The head's own settings, and the rest of its config.json as a Llama config (for its
    decoder layers, checked by the Llama field policy). Raises ValueError naming what is not
    implemented or does not fit the model."""
    architectures = raw.get("architectures") or []
    if raw.get("speculators_model_type") is not None:
        raise ValueError("speculative_config: a head in the speculators format (speculators_model_type) is not "
                         "implemented; EAGLE heads in SafeAILab's / vLLM's config.json form are")
    if not architectures or architectures[0] not in EAGLE_HEAD_ARCHITECTURES[method]:
        raise ValueError(f"speculative_config: method={method!r} takes a Llama EAGLE head "
                         f"({', '.join(EAGLE_HEAD_ARCHITECTURES[method])}); its config.json says "
                         f"architectures={architectures!r}")
    cfg = {name: value for name, value in raw.items() if name not in _EAGLE3_FIELDS}
    qwen3 = architectures[0] in _QWEN3_HEADS
    cfg["architectures"] = ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"]
    if raw.get("tie_word_embeddings"):  # (a tied head would leave its own lm_head unread)
        raise ValueError("speculative_config: an EAGLE head with tie_word_embeddings=true is not implemented (its "
                         "LM head is its own lm_head.weight, or the model's)")
    if raw.get("vocab_size") != target_vocab:
        raise ValueError(f"speculative_config: the EAGLE head's vocab_size={raw.get('vocab_size')} is not the "
                         f"model's ({target_vocab})")
    if method == "eagle":
        given = sorted(name for name in _EAGLE3_FIELDS if name in raw)
        if given:
            raise ValueError(f"speculative_config: {', '.join(given)} are EAGLE-3 fields; an EAGLE-1 head "
                             "(method='eagle') has none")
        _check_same_width(raw, target_hidden, "EAGLE-1")
        return EagleHeadConfig(1, (), target_vocab, target_hidden), cfg
    return _eagle3_head(raw, target_layers, target_hidden, target_vocab, qwen3), cfg


def _eagle3_head(raw: dict[str, Any], target_layers: int, target_hidden: int, target_vocab: int,
                 qk_norm: bool) -> EagleHeadConfig:
    nested = raw.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"speculative_config: the EAGLE head's eagle_config must be a mapping, got {nested!r}")
    unknown = sorted(set(nested) - set(_EAGLE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: the EAGLE head's eagle_config {', '.join(map(repr, unknown))} not "
                         f"implemented (implemented: {', '.join(_EAGLE_CONFIG_KEYS)})")
    flags = {name: nested.get(name, raw.get(name, False)) for name in _EAGLE3_FLAGS}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"speculative_config: the EAGLE head's {name} must be true or false, got {value!r}")
    target_hidden_size = raw.get("target_hidden_size") or raw.get("hidden_size")
    if target_hidden_size != target_hidden:
        raise ValueError(f"speculative_config: the EAGLE head reads hidden states of width "
                         f"{target_hidden_size} (target_hidden_size), the model's are {target_hidden}")
    draft_vocab = raw.get("draft_vocab_size") or target_vocab
    if not (isinstance(draft_vocab, int) and 1 <= draft_vocab <= target_vocab):
        raise ValueError(f"speculative_config: the EAGLE head's draft_vocab_size={draft_vocab!r} must be an "
                         f"integer in [1, {target_vocab}] (the model's vocabulary)")
    use_aux = nested.get("use_aux_hidden_state", True)
    layer_ids = () if use_aux is False else _aux_layer_ids(raw, nested, target_layers)
    if not layer_ids:
        _check_same_width(raw, target_hidden, "EAGLE-3 without aux hidden states")
    return EagleHeadConfig(3, layer_ids, draft_vocab, target_hidden_size, **flags, qk_norm=qk_norm)


def _aux_layer_ids(raw: dict[str, Any], nested: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The configured layers, else vLLM's default (2, L // 2, L - 3) of an L-layer model."""
    given = nested.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
    layer_ids = tuple(given) if given else (2, target_layers // 2, target_layers - 3)
    if not all(isinstance(i, int) and 0 <= i <= target_layers for i in layer_ids):
        raise ValueError(f"speculative_config: the EAGLE-3 head reads the model's layers {list(layer_ids)} "
                         f"(eagle_aux_hidden_state_layer_ids, or vLLM's default for {target_layers} layers); each "
                         f"must be in [0, {target_layers}]")
    count = raw.get("num_aux_hidden_states")
    if count is not None and count != len(layer_ids):
        raise ValueError(f"speculative_config: the EAGLE head's num_aux_hidden_states={count!r} is not the "
                         f"{len(layer_ids)} layers it reads ({list(layer_ids)})")
    return layer_ids


def _check_same_width(raw: dict[str, Any], target_hidden: int, what: str) -> None:
    if raw.get("hidden_size") != target_hidden:
        raise ValueError(f"speculative_config: an {what} head reads the model's hidden state as its own: its "
                         f"hidden_size={raw.get('hidden_size')} must be the model's ({target_hidden})")
