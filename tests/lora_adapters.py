"""PEFT LoRA adapters of the tiny models, written by PEFT itself, and PEFT's outputs with them (the
reference the engine's LoRA is held to: fp32, CPU)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from hf_reference import causal_lm_class


def make_adapter(base: Path, out: Path, *, seed: int = 0, r: int = 8, alpha: float = 16,
                 target_modules: Any = "all-linear", decoder_only: bool = False, **config: Any) -> Path:
    """A LoRA adapter of `base` saved by PEFT's save_pretrained. Both A and B are random
    (init_lora_weights=False; PEFT's default B is zero, which would change nothing), scaled so the
    adapter changes the model's greedy tokens without swamping it. `decoder_only`: of the base
    as transformers' AutoModel loads it (an embedding model's `*Model`: module names without
    the `model.` prefix)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    torch.manual_seed(seed)
    model = (AutoModel if decoder_only else causal_lm_class(base)).from_pretrained(base, dtype=torch.float32)
    peft_config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, init_lora_weights=False,
                             **config)
    peft_model = get_peft_model(model, peft_config)
    peft_model.save_pretrained(out)
    return out


def edit_adapter_config(adapter: Path, **changes: Any) -> None:
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


@functools.lru_cache(maxsize=8)
def _peft_model(base: str, adapter: str):
    from peft import PeftModel

    model = causal_lm_class(Path(base)).from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


@torch.inference_mode()
def peft_greedy(base: Path, adapter: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (one prompt at a time, EOS off) of the base model with the adapter."""
    model = _peft_model(str(base), str(adapter))
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@torch.inference_mode()
def peft_prompt_logprobs(base: Path, adapter: Path, prompt: list[int]) -> torch.Tensor:
    """Each prompt token's logprob given those before it (from the second token on)."""
    model = _peft_model(str(base), str(adapter))
    input_ids = torch.tensor([prompt])
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), prompt[1:]]


@torch.inference_mode()
def peft_hidden_states(base: Path, adapter: Path, prompt: list[int]) -> torch.Tensor:
    """The decoder's final hidden states [len(prompt), hidden] with the adapter (AutoModel: what
    an embedding model pools)."""
    from peft import PeftModel
    from transformers import AutoModel

    model = PeftModel.from_pretrained(AutoModel.from_pretrained(base, dtype=torch.float32), adapter).eval()
    return model(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()
