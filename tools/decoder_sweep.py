"""Greedy tokens of vllm_lite against transformers on tiny random-weight models of the given
model_types (transformers' config defaults shrunk to a few layers and heads, the test suite's
tokenizer), one line each: PARITY, MISMATCH, REFUSED (our error, which names the reason) or
HF FAILED (transformers could not build or run the tiny config: a shape this script does not
know for that type). For a transformers release's new decoders:

    .venv/bin/python tools/decoder_sweep.py minicpm5_moe param2moe ergo kolibri1_1 gemma4_text olmo3

A per-type override (`--set gemma4_text.hidden_size_per_layer_input=8`) fixes a type whose
defaults do not shrink. Not a test: a one-off look when transformers adds model types."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hf_reference import (_redraw_weights, _write_generation_config, build_tokenizer,  # noqa: E402
                          hf_greedy, tokenizer_vocab_size)

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "shared_intermediate_size": 64,
         "first_dense_intermediate_size": 128, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 512,
         "shared_expert_intermediate_size": 32, "mlp_only_intermediate_size": 128}
# What the defaults of some types need beside SMALL (a layer pattern, a table that does not shrink)
PER_TYPE: dict[str, dict[str, Any]] = {
    "ergo": {"num_dense_blocks": 1, "global_attention_every_n_layers": 2},
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                   "mlp_only_layers": [0], "index_topk": 16, "index_pool_size": 64, "index_num_heads": 2,
                   "index_num_local_tokens": 8, "index_num_sink_tokens": 2},
    "param2moe": {"first_k_dense_replace": 1},
    "gemma4_text": {"vocab_size_per_layer_input": 1000, "hidden_size_per_layer_input": 8},
    "qwen3_5_text": {"num_hidden_layers": 4},
    "qwen3_5_moe_text": {"num_hidden_layers": 4},
}
PROMPTS = [[5, 6, 7], list(range(10, 40)), list(range(100, 113))]
NEW_TOKENS = 8


def _has_field(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # (a per-layer attribute transformers refuses to read globally: Gemma 4's head_dim)
        return name in config.to_dict()


def build(model_type: str, out: Path, overrides: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    wanted = {**SMALL, **PER_TYPE.get(model_type, {}), **overrides}
    config = config_class(vocab_size=tokenizer_vocab_size(), bos_token_id=0, eos_token_id=2, pad_token_id=0,
                          **{name: value for name, value in wanted.items() if _has_field(defaults, name)})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        _redraw_weights(model, 0)
    except TypeError:  # (a parameter the suite's redraw does not know: a plain wide normal instead)
        torch.manual_seed(0)
        for name, param in model.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(param, std=0.2)
    model.save_pretrained(out)
    _write_generation_config(out)
    build_tokenizer(out)


def sweep_one(model_type: str, overrides: dict[str, Any]) -> str:
    from vllm_lite import LLM, SamplingParams

    out = Path(tempfile.mkdtemp(prefix=f"sweep-{model_type}-"))
    try:
        build(model_type, out, overrides)
        expected = hf_greedy(out, PROMPTS, NEW_TOKENS)
    except Exception as exc:
        return f"HF FAILED {type(exc).__name__}: {str(exc)[:300]}"
    try:
        llm = LLM(str(out), max_model_len=128, dtype="float32", multiprocess=False)
    except Exception as exc:
        return f"REFUSED {type(exc).__name__}: {str(exc)[:400]}"
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    got = [list(output.outputs[0].token_ids) for output in outputs]
    return "PARITY" if got == expected else f"MISMATCH ours {got} transformers {expected}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="+")
    parser.add_argument("--set", action="append", default=[], metavar="TYPE.FIELD=JSON",
                        help="a config field for one model type, its value as JSON")
    args = parser.parse_args()
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.set:
        target, _, value = item.partition("=")
        model_type, _, name = target.partition(".")
        overrides.setdefault(model_type, {})[name] = json.loads(value)
    for model_type in args.model_types:
        print(model_type, sweep_one(model_type, overrides.get(model_type, {})), flush=True)


if __name__ == "__main__":
    main()
