"""EAGLE and Medusa heads for the tests (tests/test_speculative_heads.py), written as SafeAILab's /
FasterDecoding's / vLLM's checkpoints name them, and a reference of what a head drafts, computed
from transformers' hidden states of the model by a plain recompute over the whole sequence (no KV
cache).

The heads draft the cycling model's walk (hf_reference.build_cycling_model: each token's
successor) plus a perturbation by the model's hidden states (`fc`'s random part, `mix`): the
drafts are mostly right and sometimes wrong, and which ones are wrong depends on the hidden
states the head reads, so the acceptance counts check that it reads the right ones.

EAGLE-1: `fc` = [identity on the token embedding, mix * random on the model's hidden state]; the
layer's attention and MLP are the model's first layer's (small: the cycling model's blocks are
scaled down); the model's LM head drafts. EAGLE-3: the first layer's attention looks at the
current position only (q = k = a constant bias, through rotary at distance 0) and copies the
token's normed embedding into the stream (v picks the embedding half, o scales it), `fc` is mix *
random over the aux states; its own LM head maps a token's embedding to its successor over a draft
vocabulary (`d2t` offsets). Medusa: head i's LM head maps a state to the token i + 2 steps along
the walk from the state's token, its residual block (mix * random) perturbs the state."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ATTENTION_SCALE = 40.0  # q = k bias size: the current position outweighs every other one
COPY_SCALE = 8.0  # o_proj: the copied embedding dominates the stream


def build_eagle1_head(out_dir: Path, model_dir: Path, mix: float, seed: int = 0) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    head = {"fc.weight": torch.cat([torch.eye(hidden), mix * torch.randn(hidden, hidden, generator=generator)
                                    / math.sqrt(hidden)], dim=1),
            "embed_tokens.weight": weights["model.embed_tokens.weight"]}
    for name, tensor in weights.items():
        if name.startswith("model.layers.0.") and "input_layernorm" not in name:
            head[name.removeprefix("model.")] = tensor
    _save(out_dir, model_dir, {**config, "num_hidden_layers": 1}, head)
    return out_dir


def build_eagle3_head(out_dir: Path, model_dir: Path, mix: float, aux_layer_ids: list[int],
                      draft_vocab_size: int, qwen3: bool = False, seed: int = 0) -> Path:
    """`qwen3`: a head with Qwen3's layers (vLLM's Eagle3Qwen3ForCausalLM: q and k normed per head,
    the norms scaled up so that the current position still wins)."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    hidden, heads, vocab = config["hidden_size"], config["num_attention_heads"], config["vocab_size"]
    head_dim = hidden // heads
    generator = torch.Generator().manual_seed(seed)
    embeddings = weights["model.embed_tokens.weight"]
    # the draft vocabulary: a random part of the model's (drafts of the others are always wrong)
    successor = _successors(weights)
    draft_ids = torch.randperm(vocab, generator=generator)[:draft_vocab_size].sort().values
    predecessor = torch.empty_like(successor)
    predecessor[successor] = torch.arange(vocab)
    unit = embeddings / embeddings.norm(dim=1, keepdim=True)
    bias = torch.zeros(head_dim)
    bias[:2] = ATTENTION_SCALE  # (rotary's fastest pair: distance 0 scores highest by far)
    head = {
        "fc.weight": mix * torch.randn(hidden, hidden * len(aux_layer_ids), generator=generator) / math.sqrt(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": torch.zeros(hidden, 2 * hidden),
        "midlayer.self_attn.q_proj.bias": bias.repeat(heads),
        "midlayer.self_attn.k_proj.weight": torch.zeros(hidden, 2 * hidden),
        "midlayer.self_attn.k_proj.bias": bias.repeat(heads),
        "midlayer.self_attn.v_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        "midlayer.self_attn.v_proj.bias": torch.zeros(hidden),
        "midlayer.self_attn.o_proj.weight": COPY_SCALE * torch.eye(hidden),
        "midlayer.self_attn.o_proj.bias": torch.zeros(hidden),
        "midlayer.mlp.gate_proj.weight": weights["model.layers.0.mlp.gate_proj.weight"],
        "midlayer.mlp.up_proj.weight": weights["model.layers.0.mlp.up_proj.weight"],
        "midlayer.mlp.down_proj.weight": torch.zeros_like(weights["model.layers.0.mlp.down_proj.weight"]),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": 10.0 * unit[predecessor[draft_ids]],
        "d2t": draft_ids - torch.arange(len(draft_ids)),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True),
    }
    extra = {"architectures": ["Eagle3Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLMEagle3"],
             "num_hidden_layers": 1, "attention_bias": True, "num_key_value_heads": heads,
             "draft_vocab_size": len(draft_ids), "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}}
    if qwen3:  # (a Qwen3 config: without Llama's own fields)
        extra["head_dim"] = head_dim
        config = {name: value for name, value in config.items() if name not in ("mlp_bias", "pretraining_tp")}
        for name in ("q_norm", "k_norm"):
            head[f"midlayer.self_attn.{name}.weight"] = ATTENTION_SCALE / 4 * torch.ones(head_dim)
    _save(out_dir, model_dir, {**config, **extra}, head)
    return out_dir


def build_medusa_head(out_dir: Path, model_dir: Path, mix: float, num_heads: int, old_names: bool = False,
                      seed: int = 0) -> Path:
    """`old_names`: FasterDecoding's tensor names and config fields, else vLLM's converted form."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(model_dir / "model.safetensors")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    successor = _successors(weights)
    embeddings = weights["model.embed_tokens.weight"]
    unit = embeddings / embeddings.norm(dim=1, keepdim=True)
    source = torch.arange(vocab)  # head i's row for token T: the embedding of T's (i + 2)-th predecessor
    predecessor = torch.empty_like(successor)
    predecessor[successor] = torch.arange(vocab)
    head = {}
    for i in range(num_heads):
        source = predecessor[source] if i else predecessor[predecessor]
        linear = mix * torch.randn(hidden, hidden, generator=generator) / math.sqrt(hidden)
        block, lm_head = (f"{i}.0.linear.weight", f"{i}.1.weight") if old_names else \
            (f"blocks.{i}.layers.0.weight", f"lm_heads.{i}.weight")
        head[block] = linear
        head[lm_head] = 10.0 * unit[source]
    medusa_config = ({"medusa_num_heads": num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "cycling"}
                     if old_names else {"architectures": ["MedusaModel"], "model_type": "medusa",
                                        "hidden_size": hidden, "vocab_size": vocab, "num_heads": num_heads,
                                        "num_hidden_layers": 1, "truncated_vocab_size": vocab})
    _save(out_dir, model_dir, medusa_config, head)
    return out_dir


class ReferenceMedusa:
    """What a Medusa head drafts after a sequence: its heads over transformers' last hidden state
    of the model at the position before the last token."""

    def __init__(self, head_dir: Path, model) -> None:
        self.w = {name: tensor.double() for name, tensor in load_file(head_dir / "model.safetensors").items()}
        self.model = model.double()

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        state = self.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0, -2]
        drafts = []
        for i in range(k):
            linear = self.w.get(f"blocks.{i}.layers.0.weight", self.w.get(f"{i}.0.linear.weight"))
            lm_head = self.w.get(f"lm_heads.{i}.weight", self.w.get(f"{i}.1.weight"))
            x = state + torch.nn.functional.silu(linear @ state)
            drafts.append(int((lm_head @ x).argmax()))
        return drafts


def _successors(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The cycling model's bigram: the token whose LM head row best matches each embedding."""
    embeddings = weights["model.embed_tokens.weight"]
    unit = embeddings / embeddings.norm(dim=1, keepdim=True)
    return (unit @ weights["lm_head.weight"].T).argmax(dim=1)


def _save(out_dir: Path, model_dir: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out_dir / name)


class ReferenceHead:
    """What an EAGLE head drafts after a sequence, from transformers' hidden states of the model:
    the head over every position again (no cache), then its later drafts one pass each."""

    def __init__(self, head_dir: Path, model) -> None:
        self.config = json.loads((head_dir / "config.json").read_text())
        self.w = {name: tensor.double() if tensor.is_floating_point() else tensor
                  for name, tensor in load_file(head_dir / "model.safetensors").items()}
        self.model = model.double()
        self.version = 3 if "d2t" in self.w else 1
        self.aux = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        prefix = "midlayer." if self.version == 3 else "layers.0."
        self.layer = {name.removeprefix(prefix): tensor for name, tensor in self.w.items() if name.startswith(prefix)}

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        ids = torch.tensor([tokens])
        pre_norm = []
        hook = self.model.model.norm.register_forward_pre_hook(lambda module, args: pre_norm.append(args[0]))
        try:
            out = self.model(ids, output_hidden_states=True)
        finally:
            hook.remove()
        # transformers' hidden_states: each layer's input, then the normed output; vLLM's aux id
        # num_layers is the stream before that norm
        streams = [*out.hidden_states[:-1], pre_norm[0]]
        states = (torch.cat([streams[i][0] for i in self.aux], dim=-1) if self.version == 3
                  else out.hidden_states[-1][0])[:-1]  # (position p reads the token at p + 1)
        if self.version == 3:
            states = states @ self.w["fc.weight"].T
        inputs, drafts = tokens[1:], []
        carried = states
        for _ in range(k):
            logits_states, carried_all = self._forward(torch.tensor(inputs), carried)
            drafts.append(self._token(logits_states[-1]))
            inputs = inputs + [drafts[-1]]
            carried = torch.cat([carried, carried_all[-1:]])  # (the next pass reads its own output there)
        return drafts

    def _forward(self, input_ids: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.model.model.embed_tokens.weight[input_ids] if "embed_tokens.weight" not in self.w \
            else self.w["embed_tokens.weight"][input_ids]
        lw = self.layer
        eps = self.config["rms_norm_eps"]
        if self.version == 1:
            x = torch.cat([embeds, states], dim=-1) @ self.w["fc.weight"].T
            residual = x
            attn_in = x
        else:
            residual = states
            attn_in = torch.cat([_rms(embeds, lw["input_layernorm.weight"], eps),
                                 _rms(states, lw["hidden_norm.weight"], eps)], dim=-1)
        x = self._attention(attn_in) + residual
        x = x + self._mlp(_rms(x, lw["post_attention_layernorm.weight"], eps))
        if self.version == 1:
            return x, x
        return _rms(x, self.w["norm.weight"], eps), x

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        lw, cfg = self.layer, self.config
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        d = cfg["hidden_size"] // heads
        n = x.shape[0]

        def proj(name: str, count: int) -> torch.Tensor:
            out = x @ lw[f"self_attn.{name}.weight"].T
            if f"self_attn.{name}.bias" in lw:
                out = out + lw[f"self_attn.{name}.bias"]
            return out.view(n, count, d).transpose(0, 1)

        q, k, v = proj("q_proj", heads), proj("k_proj", kv_heads), proj("v_proj", kv_heads)
        if "self_attn.q_norm.weight" in lw:  # (Qwen3's layers)
            q = _rms(q, lw["self_attn.q_norm.weight"], cfg["rms_norm_eps"])
            k = _rms(k, lw["self_attn.k_norm.weight"], cfg["rms_norm_eps"])
        q, k = _rotary(q, cfg["rope_theta"]), _rotary(k, cfg["rope_theta"])
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
        out = out @ lw["self_attn.o_proj.weight"].T
        return out + lw["self_attn.o_proj.bias"] if "self_attn.o_proj.bias" in lw else out

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        lw = self.layer
        gate, up = x @ lw["mlp.gate_proj.weight"].T, x @ lw["mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ lw["mlp.down_proj.weight"].T

    def _token(self, logits_state: torch.Tensor) -> int:
        if self.version == 1:
            return int(self.model.lm_head(logits_state[None])[0].argmax())
        best = int((logits_state @ self.w["lm_head.weight"].T).argmax())
        return best + int(self.w["d2t"][best])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary (halves rotated) on [heads, positions, head_dim]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + rotated * sin
