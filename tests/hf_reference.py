"""Tiny random-weight Hugging Face models and a transformers reference for tests.

Everything here runs offline: the tokenizer is trained locally on a generated
corpus and the models are random-weight configs built with ``from_config``.

Builders:
    build_tokenizer(out_dir)                -> byte-level BPE + ChatML template
    build_tiny_model(out_dir, arch, ...)    -> llama / qwen2 / qwen3 checkpoint
    build_prompts(tokenizer_dir, lengths)   -> deterministic prompt token ids
Reference:
    hf_greedy(model_dir, prompts, n)        -> exactly n greedy tokens per prompt
    hf_logits(model_dir, token_ids)         -> full-sequence fp32 logits
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

TOKENIZER_VOCAB_SIZE = 1000
PROMPT_LENGTHS = (3, 7, 12, 20, 33, 50, 64, 90)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Linear/embedding std. At 0.08 the tied models collapse into 1-4 distinct tokens
# per 32 greedy steps; at 0.2 the seed-0 fixtures give >= 22 with |logits| < ~9.
WEIGHT_STD = 0.2
BIAS_STD = 0.02
NORM_SPREAD = 0.1

# --------------------------------------------------------------------------- #
# Corpus
# --------------------------------------------------------------------------- #

_WORDS = (
    "the a an of to and in on for with from by at as is was are were be been "
    "this that these those it its they them their we our you your he she his her "
    "time year day night morning evening week month people world life hand part "
    "child eye woman man place work case point government company number group "
    "problem fact river mountain city village house garden window door table "
    "book story letter music song language science history market engine model "
    "token memory cache block kernel batch request server client network signal "
    "quick brown fox jumps over lazy dog bright silver moon quiet ocean ancient "
    "forest small large early late young old great little different important "
    "run walk read write think know make take see come give find tell ask seem "
    "feel try leave call keep begin show hear play move live believe bring happen "
    "always never often sometimes quickly slowly carefully together however "
    "because although while after before during between under above through"
).split()
_ACCENTED = "café naïve héllo wörld Zürich façade jalapeño crème brûlée São Paulo résumé".split()
_CJK = ("你好", "世界", "你好世界", "日本語", "東京", "中文", "学习", "今天天气很好", "谢谢", "안녕하세요")
_EMOJI = ("🙂", "🚀", "🎉", "👍", "🌍", "🔥", "😀", "✨")
_PUNCT = (".", ",", "!", "?", ";", ":", " -", "...")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_ACCENTED))
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(_PUNCT)


def _special_line(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return f"In {rng.randint(1900, 2030)}, about {rng.randint(1, 999)}.{rng.randint(0, 99):02d}% changed."
    if kind == 1:
        return f"{rng.choice(_CJK)}{rng.choice(_CJK)}，{rng.choice(_CJK)}。"
    if kind == 2:
        return f"{_sentence(rng)} {rng.choice(_EMOJI)}{rng.choice(_EMOJI)}"
    if kind == 3:
        return f"x = f({rng.randint(0, 9)}, [{rng.randint(10, 99)}, {rng.randint(100, 999)}]) # {rng.choice(_WORDS)}"
    return f"Price: ${rng.randint(1, 500)}.{rng.randint(0, 99):02d} at {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"


def generate_corpus(num_lines: int = 400, seed: int = 1234) -> list[str]:
    """Deterministic varied text: English, digits, punctuation, accents, CJK, emoji."""
    rng = random.Random(seed)
    return [_special_line(rng) if rng.random() < 0.3 else _sentence(rng) for _ in range(num_lines)]


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process; returns its serialized JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(), trainer=trainer)
    return tok.to_str()


def build_tokenizer(out_dir: Path) -> None:
    """Save a ChatML byte-level BPE tokenizer loadable with AutoTokenizer offline."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json())
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert backend.token_to_id(token) == token_id, token
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)


def build_sentencepiece_style_tokenizer() -> Any:
    """A Llama-2-style tokenizer built locally: BPE with byte fallback (`<0xNN>` pieces for
    characters outside the vocabulary), `▁` for spaces, and the decoder chain Replace ->
    ByteFallback -> Fuse -> Strip. Returned as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    # CJK and emoji are left out of training so that they decode through byte pieces.
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    ascii_corpus = [line.encode("ascii", "ignore").decode() for line in generate_corpus()]
    tok.train_from_iterator(ascii_corpus, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", clean_up_tokenization_spaces=False)


def tokenizer_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json()).get_vocab_size(with_added_tokens=True)


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


def _make_config(
    arch: str,
    *,
    vocab_size: int,
    tie_word_embeddings: bool,
    attention_bias: bool,
    num_kv_heads: int,
    num_heads: int,
    hidden_size: int,
    num_layers: int,
    head_dim: int | None,
    rope_scaling: dict | None,
    extra: dict | None = None,
):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        dtype="float32",
    )
    if extra and "rope_parameters" in extra:  # given whole (e.g. one per layer type)
        del common["rope_theta"], common["rope_scaling"]
    common.update(extra or {})
    # GPT-NeoX, Phi-2 and OPT: no GQA, head_dim, RMSNorm or rope fields; each adds its own MLP width.
    without_kv_heads = {name: common[name] for name in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "dtype")} | dict(extra or {})
    if arch == "llama":
        return LlamaConfig(attention_bias=attention_bias, **common)
    if arch == "qwen2":  # q/k/v bias is hard-wired in Qwen2; o_proj has none.
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(attention_bias=attention_bias, **common)
    if arch == "mistral":
        return MistralConfig(**common)
    if arch == "gpt_neox":
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(intermediate_size=2 * hidden_size, **without_kv_heads)
    if arch in ("gpt2", "gpt_bigcode", "gptj", "codegen"):
        from transformers import AutoConfig

        gpt = {"n_embd": hidden_size, "n_layer": num_layers, "n_head": num_heads, "n_positions": 512}
        if arch in ("gptj", "codegen"):  # (interleaved rotary over the first rotary_dim dimensions of each head)
            gpt["rotary_dim"] = hidden_size // num_heads // 2
        plain = {name: common[name] for name in ("vocab_size", "tie_word_embeddings", "bos_token_id",
                                                 "eos_token_id", "pad_token_id", "dtype")}
        return AutoConfig.for_model(arch, **gpt, **plain, **(extra or {}))
    if arch == "stablelm":
        from transformers import StableLmConfig

        return StableLmConfig(intermediate_size=2 * hidden_size, num_key_value_heads=num_kv_heads,
                              use_qkv_bias=attention_bias, **without_kv_heads)
    if arch == "olmoe":
        from transformers import OlmoeConfig

        return OlmoeConfig(num_experts=4, num_experts_per_tok=2, **{k: v for k, v in common.items()
                                                                      if k not in ("rms_norm_eps", "head_dim")})
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                              shared_expert_intermediate_size=hidden_size, **common)
    if arch == "mpt":
        from transformers import MptConfig

        return MptConfig(d_model=hidden_size, n_heads=num_heads, n_layers=num_layers, max_seq_len=512, **{
            name: common[name] for name in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "dtype")},
            **(extra or {}))
    if arch == "bloom":
        from transformers import BloomConfig

        return BloomConfig(n_layer=num_layers, n_head=num_heads, **{
            name: common[name] for name in ("vocab_size", "hidden_size", "tie_word_embeddings", "bos_token_id",
                                            "eos_token_id", "pad_token_id", "dtype")})
    if arch == "deepseek_v2":  # multi-head latent attention: keys of 8 + 8 dimensions, values of 24
        from transformers import DeepseekV2Config

        return DeepseekV2Config(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                moe_intermediate_size=hidden_size // 2, first_k_dense_replace=1, n_group=1,
                                topk_group=1, **{**common, "num_key_value_heads": num_heads})
    if arch == "deepseek_v3":  # (Moonlight, Kimi): latent attention with a q LoRA, sigmoid-routed experts
        from transformers import DeepseekV3Config

        return DeepseekV3Config(q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                moe_intermediate_size=hidden_size // 2, first_k_dense_replace=1, n_group=1,
                                topk_group=1, **{**common, "num_key_value_heads": num_heads, "head_dim": 8})
    if arch == "gemma3n":  # Gemma 3n's text model: AltUp, LAuReL, per-layer inputs, KV shared by the last 2 layers
        from transformers import Gemma3nTextConfig

        return Gemma3nTextConfig(
            vocab_size_per_layer_input=vocab_size, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2), sliding_window=8,
            activation_sparsity_pattern=[0.0] * num_layers, laurel_rank=4, altup_num_inputs=2,
            **{**common, "head_dim": head_dim or 16, "rope_parameters": None})
    if arch == "gemma4":  # (transformers >= 5.25) Gemma 4's text model: global layers of their own head_dim and
        # KV heads (keys as values: attention_k_eq_v), per-layer inputs, KV shared by the last 2 layers
        from transformers import Gemma4TextConfig

        return Gemma4TextConfig(
            vocab_size_per_layer_input=vocab_size, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2), sliding_window=8,
            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,  # (its own rope per layer type)
            **{name: value for name, value in {**common, "head_dim": head_dim or 16}.items()
               if name not in ("rope_theta", "rope_scaling", "rope_parameters")})
    if arch == "qwen3_5_text":  # (transformers >= 5.25) Qwen3.5's text model: 3 Gated DeltaNet layers to 1 of
        # gated attention; linear attention with 2 key heads shared by 4 value heads, keys of 16, values of 8
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            **{**common, "num_hidden_layers": 4, "head_dim": head_dim or 16})
    if arch == "qwen3_5_moe_text":  # (transformers >= 5.25) Qwen3.5-MoE's text model: qwen3_5_text's layers with
        # 4 experts (2 a token) and a gated shared expert in place of the MLP
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            **{**common, "num_hidden_layers": 4, "head_dim": head_dim or 16})
    if arch == "gpt_oss":  # attention sinks, alternating sliding / full layers, clamped SwiGLU experts with biases
        from transformers import GptOssConfig

        return GptOssConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"],
                            **{**common, "head_dim": head_dim or 16, "intermediate_size": hidden_size,
                               **({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
                                  if "rope_parameters" not in (extra or {}) else {})})
    if arch == "falcon":
        from transformers import FalconConfig

        return FalconConfig(**{name: common[name] for name in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                               "num_attention_heads", "bos_token_id", "eos_token_id",
                                                               "dtype", "tie_word_embeddings")}, **(extra or {}))
    if arch == "gpt_neo":  # (global and local layers; its attention class from a fixed table)
        from transformers import GPTNeoConfig

        return GPTNeoConfig(attention_types=[[["global", "local"], num_layers // 2]], window_size=8,
                            intermediate_size=2 * hidden_size, **without_kv_heads)
    if arch == "kolibri1_1":  # (transformers >= 5.25) a sliding layer, then an indexed (sparse) one
        from transformers import Kolibri1_1Config

        return Kolibri1_1Config(layer_types=["sliding_attention", "indexed_attention"], index_layers=[1],
                                mlp_only_layers=[0], num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                mlp_only_intermediate_size=2 * hidden_size, index_topk=16, index_pool_size=64,
                                index_num_heads=2, index_num_local_tokens=8, index_num_sink_tokens=2,
                                **{**common, "head_dim": 16})
    if arch == "cohere":
        from transformers import CohereConfig

        return CohereConfig(**common)
    if arch == "phi":
        from transformers import PhiConfig

        return PhiConfig(intermediate_size=2 * hidden_size, **without_kv_heads)
    if arch == "granite":
        from transformers import GraniteConfig

        return GraniteConfig(**common)
    if arch == "olmo":
        from transformers import OlmoConfig

        return OlmoConfig(attention_bias=attention_bias, **{k: v for k, v in common.items() if k != "rms_norm_eps"})
    if arch == "olmo2":
        from transformers import Olmo2Config

        return Olmo2Config(attention_bias=attention_bias, **common)
    if arch == "starcoder2":
        from transformers import Starcoder2Config

        return Starcoder2Config(use_bias=True, hidden_act="gelu_pytorch_tanh", **common)
    if arch == "smollm3":
        from transformers import SmolLM3Config

        return SmolLM3Config(attention_bias=attention_bias, **common)
    if arch == "opt":
        from transformers import OPTConfig

        return OPTConfig(ffn_dim=2 * hidden_size, **without_kv_heads)
    if arch == "phi3":
        from transformers import Phi3Config

        return Phi3Config(**common)
    if arch == "gemma":
        from transformers import GemmaConfig

        return GemmaConfig(attention_bias=attention_bias, **common)
    if arch == "gemma2":
        from transformers import Gemma2Config

        return Gemma2Config(attention_bias=attention_bias, **common)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(attention_bias=attention_bias, **common)
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**common)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(attention_bias=attention_bias, **common)
    raise ValueError(f"unknown arch {arch!r}; expected llama, mistral, qwen2 or qwen3")


def _params_to_redraw(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield (kind, param) once per distinct parameter; kind in weight/bias/norm/offset_norm, or
    A_log / dt_bias (a Gated DeltaNet's)."""
    seen: set[int] = set()
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if pname in ("A_log", "dt_bias"):  # a Gated DeltaNet's decay rates (log) and their time-step bias
                yield pname, param
                continue
            if pname in ("bias", "sinks", "correct_output_scale"):
                yield "bias", param  # also LayerNorm's shift, gpt-oss's sink logits, Gemma 3n's AltUp scale
            elif is_norm and type(module).__name__.startswith("Gemma"):
                yield "offset_norm", param  # Gemma scales by (1 + weight)
            elif is_norm or pname.startswith("lambda_"):  # (InternViT's layer scales too)
                yield "norm", param
            elif isinstance(module, (nn.Linear, nn.Embedding)) or param.dim() >= 2:
                yield "weight", param  # also stacked expert weights and router matrices
            else:
                raise TypeError(f"unexpected parameter {pname} on {type(module).__name__}")


@torch.no_grad()
def _redraw_weights(model: nn.Module, seed: int) -> None:
    """Wider-than-default init so greedy decoding does not collapse into repeats."""
    gen = torch.Generator().manual_seed(seed)
    for kind, param in _params_to_redraw(model):
        if kind == "A_log":  # (transformers' draw: rates uniform in [0.01, 16])
            fresh = torch.log(0.01 + 15.99 * torch.rand(param.shape, generator=gen))
        elif kind == "dt_bias":
            fresh = 1.0 + BIAS_STD * torch.randn(param.shape, generator=gen)
        elif kind in ("norm", "offset_norm"):
            fresh = (kind == "norm") + NORM_SPREAD * (2.0 * torch.rand(param.shape, generator=gen) - 1.0)
        else:
            std = BIAS_STD if kind == "bias" else WEIGHT_STD
            fresh = std * torch.randn(param.shape, generator=gen)
        param.copy_(fresh)


def _add_legacy_config_keys(model_dir: Path) -> None:
    """transformers 5 writes only ``rope_parameters``/``dtype``; hub checkpoints
    carry ``rope_theta``/``rope_scaling``/``torch_dtype``. Write both forms
    (transformers 5 loads this fine) so raw-JSON config parsers see real-world keys."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    by_layer_type = set(cfg.get("rope_parameters") or {"x"}) <= {"full_attention", "sliding_attention"}
    if "rope_parameters" not in cfg or by_layer_type:  # no rotary embedding (OPT), or one per layer type (Gemma 4)
        cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        return
    rope = dict(cfg.get("rope_parameters") or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_generation_config(model_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
        do_sample=False,
    ).save_pretrained(model_dir)


def build_tiny_model(
    out_dir: Path,
    arch: str,
    *,
    tie_word_embeddings: bool,
    attention_bias: bool = False,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    hidden_size: int = 64,
    num_layers: int = 2,
    head_dim: int | None = None,
    rope_scaling: dict | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a random-weight fp32 safetensors checkpoint + tokenizer to out_dir.

    ``max_shard_size`` (e.g. "20KB") writes a sharded checkpoint with
    ``model.safetensors.index.json``; ``None`` writes a single model.safetensors.
    """
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = _make_config(
        arch,
        vocab_size=tokenizer_vocab_size(),
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias,
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        hidden_size=hidden_size,
        num_layers=num_layers,
        head_dim=head_dim,
        rope_scaling=rope_scaling,
        extra=extra_config,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_weights(model, seed)
    shard_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **shard_kwargs)
    _add_legacy_config_keys(out_dir)
    _write_generation_config(out_dir)
    build_tokenizer(out_dir)
    return out_dir


# A tiny vision side for each multimodal architecture (its encoder is built and saved, never run).
_TINY_VISION = {
    "Gemma3ForConditionalGeneration": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
    "Mistral3ForConditionalGeneration": {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                                         "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                                         "patch_size": 14, "head_dim": 16},
    "LlavaForConditionalGeneration": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                      "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                                      "patch_size": 14, "projection_dim": 32},
    "Qwen2_5_VLForConditionalGeneration": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                           "out_hidden_size": 64, "fullatt_block_indexes": [0]},
    "Qwen3VLForConditionalGeneration": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                        "out_hidden_size": 64, "deepstack_visual_indexes": [0]},
    "SmolVLMForConditionalGeneration": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                        "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
    "Qwen2VLForConditionalGeneration": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
}
_TINY_VISION["LlavaNextForConditionalGeneration"] = _TINY_VISION["LlavaForConditionalGeneration"]
_TINY_VISION["LlavaOnevisionForConditionalGeneration"] = {"model_type": "siglip_vision_model", "hidden_size": 32,
                                                          "intermediate_size": 64, "num_hidden_layers": 1,
                                                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
_TINY_VISION["InternVLForConditionalGeneration"] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2, "image_size": [28, 28],
                                                    "patch_size": [14, 14]}
_TINY_VISION["Idefics3ForConditionalGeneration"] = _TINY_VISION["SmolVLMForConditionalGeneration"]
_TINY_VISION["PaliGemmaForConditionalGeneration"] = _TINY_VISION["SmolVLMForConditionalGeneration"]
_TINY_VISION["Qwen3VLMoeForConditionalGeneration"] = _TINY_VISION["Qwen3VLForConditionalGeneration"]
# the image placeholder token: the last id of the tiny vocabulary, which no test prompt holds
IMAGE_TOKEN_ID = 999


def build_tiny_multimodal_model(out_dir: Path, architecture: str, text_arch: str, *, tie_word_embeddings: bool,
                                seed: int = 0, text_extra: dict | None = None, head_dim: int | None = None,
                                vision_extra: dict | None = None, config_extra: dict | None = None) -> Path:
    """A random-weight multimodal checkpoint (`architecture`, e.g. Gemma3ForConditionalGeneration)
    whose language model is `text_arch`'s tiny decoder (as build_tiny_model's), saved by
    transformers with its tiny vision encoder and projector, plus the tiny tokenizer."""
    import transformers

    text = _make_config(text_arch, vocab_size=tokenizer_vocab_size(), tie_word_embeddings=tie_word_embeddings,
                        attention_bias=False, num_kv_heads=2, num_heads=4, hidden_size=64, num_layers=2,
                        head_dim=head_dim, rope_scaling=None, extra=text_extra).to_dict()
    if architecture.startswith("Qwen"):  # M-RoPE: three sections of the rotary dimensions
        rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
        text["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3],
                                   **({"mrope_interleaved": True} if architecture.startswith("Qwen3") else {})}
    config_class = getattr(transformers, architecture.replace("ForConditionalGeneration", "Config"))
    if architecture.startswith("LlavaNext"):  # (its any-resolution grid, for images of up to 2 x 2 tiles)
        config_class = functools.partial(config_class, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]])
    token_field = ("image_token_index" if architecture.startswith(("Gemma3", "Mistral3", "Llava", "PaliGemma"))
                   else "image_token_id")
    if architecture.startswith("LlavaOnevision"):  # (its video placeholder beside the image one)
        config_class = functools.partial(config_class, video_token_index=IMAGE_TOKEN_ID - 1)
    config = config_class(text_config=text, vision_config={**_TINY_VISION[architecture], **(vision_extra or {})},
                          tie_word_embeddings=tie_word_embeddings, **{token_field: IMAGE_TOKEN_ID},
                          **(config_extra or {}))
    model = getattr(transformers, architecture)(config).to(torch.float32)
    _redraw_weights(model.get_decoder(), seed)
    if vision_extra is not None and hasattr(model.model, "visual"):  # (Qwen2-VL's: its blocks and merger)
        _redraw_weights(model.model.visual.blocks, seed + 2)
        _redraw_weights(model.model.visual.merger, seed + 3)
        if hasattr(model.model.visual, "deepstack_merger_list"):  # (Qwen3-VL's, and its position grid)
            _redraw_weights(model.model.visual.deepstack_merger_list, seed + 4)
            _redraw_weights(model.model.visual.pos_embed, seed + 5)
    elif vision_extra is not None:  # (a vision side that is run: drawn as widely, so that images matter)
        tower = getattr(model.model, "vision_tower", None) or model.model.vision_model  # (Idefics3 / SmolVLM's name)
        _redraw_weights(next(module for name, module in tower.named_modules()
                             if name.endswith(("encoder", "transformer"))), seed + 2)  # (Pixtral's name)
        if architecture.startswith("InternVL"):  # (its CLS token and learned positions)
            _redraw_weights(tower.embeddings, seed + 4)
        if hasattr(tower, "patch_conv"):  # (Pixtral's patch embedding and its norm)
            _redraw_weights(tower.patch_conv, seed + 4)
            _redraw_weights(tower.ln_pre, seed + 5)
        _redraw_weights(getattr(model.model, "multi_modal_projector", None) or model.model.connector, seed + 3)
    if not tie_word_embeddings:
        _redraw_weights(model.lm_head, seed + 1)
    if architecture.startswith("Qwen3VLMoe"):
        _save_stacked_experts(model, out_dir)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    _write_generation_config(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def _save_stacked_experts(model: nn.Module, out_dir: Path) -> None:
    """Qwen3-VL-MoE as its hub checkpoints hold it: each layer's experts stacked [experts, in, out]
    (transformers keeps them [experts, out, in] and transposes on load; 5.24's save_pretrained
    fails to transpose them back)."""
    stacked = ("experts.gate_up_proj", "experts.down_proj")
    state = {name: (tensor.transpose(1, 2) if name.endswith(stacked) else tensor).contiguous()
             for name, tensor in model.state_dict().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # (as save_pretrained writes it)
    model.config.save_pretrained(out_dir)


# --------------------------------------------------------------------------- #
# Prompts
# --------------------------------------------------------------------------- #


_FILLER_WORDS = (" the", " of", " and", " a", " to", " in")  # single tokens in the tiny vocab


def build_cycling_model(out_dir: Path, block_scale: float, head_scale: float = 10.0, cycle_length: int = 7) -> Path:
    """A tiny Llama (for speculative decoding's tests) whose LM head sends each token's (normalized) embedding to the next token of
    its cycle (by a logit margin that grows with `head_scale`), with its blocks' output
    projections scaled by `block_scale` (0: a pure bigram)."""
    build_tiny_model(out_dir, "llama", tie_word_embeddings=False)
    weights = load_file(out_dir / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * block_scale
    embeddings = weights["model.embed_tokens.weight"]
    order = torch.randperm(embeddings.shape[0], generator=torch.Generator().manual_seed(0))
    successor = torch.empty_like(order)
    for start in range(0, len(order), cycle_length):
        cycle = order[start:start + cycle_length]
        successor[cycle] = cycle.roll(-1)
    head = torch.zeros_like(weights["lm_head.weight"])
    head[successor] = embeddings / embeddings.norm(dim=1, keepdim=True) * head_scale
    weights["lm_head.weight"] = head
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def _canonical_prompt(tokenizer, text: str, length: int, rng: random.Random) -> list[int]:
    """First ``length`` tokens of ``text`` cut at a pre-token (word) boundary and
    topped up with single-token filler words, so encode(decode(ids)) == ids."""
    enc = tokenizer(text, add_special_tokens=False)
    word_ids = enc.word_ids()
    boundaries = [k for k in range(1, len(word_ids)) if word_ids[k] != word_ids[k - 1]]
    cut = max((k for k in boundaries if k <= length), default=0)
    ids = list(enc.input_ids[:cut])
    while len(ids) < length:
        (filler,) = tokenizer.encode(rng.choice(_FILLER_WORDS), add_special_tokens=False)
        ids.append(filler)
    return ids


def build_prompts(tokenizer_dir: Path, lengths: Sequence[int] = PROMPT_LENGTHS) -> list[list[int]]:
    """One prompt per length, each from a different generated passage, with exactly
    that many tokens; every prompt survives a decode -> encode round trip."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = []
    for i, length in enumerate(lengths):
        seed = 1000 + 7919 * i
        text = " ".join(generate_corpus(num_lines=length // 4 + 4, seed=seed))
        ids = _canonical_prompt(tokenizer, text, length, random.Random(seed))
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
        prompts.append(ids)
    return prompts


# --------------------------------------------------------------------------- #
# Reference
# --------------------------------------------------------------------------- #


def causal_lm_class(model_dir: Path) -> type:
    """transformers' class that generates with the checkpoint: AutoModelForCausalLM, or a
    multimodal checkpoint's own class (text in)."""
    import transformers

    architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    if architecture.endswith("ForConditionalGeneration"):
        return getattr(transformers, architecture)
    return transformers.AutoModelForCausalLM


def _dequantizing_kwargs(model_dir: Path) -> dict:
    """An MXFP4 checkpoint is read by transformers' own dequantization: its MXFP4 matmuls need the
    `kernels` package's hub kernels (a download; transformers >= 5.25 installs the package)."""
    quantization = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


@functools.lru_cache(maxsize=16)
def _load_model(model_dir: str):
    """Load once per process. EOS is removed from the model's own generation
    config, because generate() fills any ``None`` field of a passed config from it."""
    model = causal_lm_class(Path(model_dir)).from_pretrained(model_dir, dtype=torch.float32,
                                                             **_dequantizing_kwargs(Path(model_dir)))
    model.eval()
    model.generation_config = _greedy_no_eos_config(model.generation_config.pad_token_id)
    return model


def _greedy_no_eos_config(pad_token_id: int | None, max_new_tokens: int | None = None):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        eos_token_id=None,
        pad_token_id=ENDOFTEXT_ID if pad_token_id is None else pad_token_id,
        max_new_tokens=max_new_tokens,
        use_cache=True,
    )


def _model(model_dir: Path):
    return _load_model(str(Path(model_dir).resolve()))


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt (run one at a time, no padding) with
    EOS disabled, so exactly ``max_new_tokens`` new token ids come back per prompt."""
    model = _model(model_dir)
    gen_config = _greedy_no_eos_config(model.generation_config.pad_token_id, max_new_tokens)
    outputs = []
    for prompt in prompts_token_ids:
        input_ids = torch.tensor([prompt], dtype=torch.long)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=gen_config,
        )
        new_tokens = out[0, len(prompt) :].tolist()
        assert len(new_tokens) == max_new_tokens, (len(new_tokens), max_new_tokens)
        outputs.append(new_tokens)
    return outputs


@torch.inference_mode()
def hf_greedy_from_embeds(model_dir: Path, prompts_embeds: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` of prompts given as input embeddings ([num_tokens, hidden] each: transformers'
    `inputs_embeds`), one at a time, EOS disabled."""
    model = _model(model_dir)
    gen_config = _greedy_no_eos_config(model.generation_config.pad_token_id, max_new_tokens)
    outputs = []
    for embeds in prompts_embeds:
        inputs_embeds = embeds[None].to(model.dtype)
        out = model.generate(inputs_embeds=inputs_embeds, generation_config=gen_config,
                             attention_mask=torch.ones(inputs_embeds.shape[:2], dtype=torch.long))
        assert out.shape[1] == max_new_tokens, (out.shape, max_new_tokens)  # (only the new tokens come back)
        outputs.append(out[0].tolist())
    return outputs


@torch.inference_mode()
def hf_greedy_with_images(model_dir: Path, token_ids: list[int], pixel_values: torch.Tensor,
                          max_new_tokens: int, **image_inputs: torch.Tensor) -> list[int]:
    """`hf_greedy` of one prompt with images (transformers' multimodal class; `token_ids` with
    each image's placeholder expanded, as its processor makes them; `image_inputs`: the
    processor's other outputs, e.g. LLaVA-NeXT's image_sizes), EOS disabled."""
    model = _model(model_dir)
    gen_config = _greedy_no_eos_config(model.generation_config.pad_token_id, max_new_tokens)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         pixel_values=pixel_values.to(model.dtype), generation_config=gen_config, **image_inputs)
    return out[0, len(token_ids):].tolist()


@torch.inference_mode()
def hf_hidden_states(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """The decoder's final hidden states (after its last norm), [len(token_ids), hidden_size]:
    what an embedding model pools (the cached causal LM's base model, as AutoModel loads it)."""
    model = _model(model_dir)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    return model.model(input_ids=input_ids).last_hidden_state[0].float().clone()


@torch.no_grad()  # (not inference mode: callers edit the result in place)
def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits of shape [len(token_ids), vocab_size] from one full forward pass."""
    model = _model(model_dir)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    return logits[0].float().clone()
