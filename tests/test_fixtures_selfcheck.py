"""Sanity checks for the shared tiny-model fixtures and the HF reference helpers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_reference import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    PROMPT_LENGTHS,
    build_prompts,
    hf_greedy,
    hf_logits,
)

ALL_MODEL_FIXTURES = (
    "tiny_llama",
    "tiny_llama_tied",
    "tiny_qwen2",
    "tiny_qwen3",
    "tiny_llama_sharded",
    "tiny_llama3_rope",
)
MAX_NEW_TOKENS = 32
MIN_DISTINCT = 8


def test_tokenizer_round_trip(tiny_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    for text in ("héllo wörld 你好 🙂", "  spaces\tand\nnewlines ", "x=1.5e-3; ∑ ∫ 🚀🇯🇵", ""):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert 900 <= len(tokenizer) <= 1000
    assert tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (ENDOFTEXT, IM_END, ENDOFTEXT)


def test_chat_template(tiny_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 3


def test_prompts(prompts_token_ids: list[list[int]], tiny_tokenizer_dir: Path) -> None:
    assert [len(p) for p in prompts_token_ids] == list(PROMPT_LENGTHS)
    assert build_prompts(tiny_tokenizer_dir) == prompts_token_ids
    assert len({tuple(p[:3]) for p in prompts_token_ids}) == len(prompts_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    for ids in prompts_token_ids:
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


@pytest.mark.parametrize("fixture_name", ALL_MODEL_FIXTURES)
def test_model_loads_and_does_not_collapse(
    fixture_name: str, request: pytest.FixtureRequest, prompts_token_ids: list[list[int]]
) -> None:
    model_dir: Path = request.getfixturevalue(fixture_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(model_dir))
    outputs = hf_greedy(model_dir, prompts_token_ids, MAX_NEW_TOKENS)
    assert [len(o) for o in outputs] == [MAX_NEW_TOKENS] * len(prompts_token_ids)
    for prompt, new_tokens in zip(prompts_token_ids, outputs):
        assert len(set(new_tokens)) >= MIN_DISTINCT, (len(prompt), new_tokens)


def test_model_variants(
    tiny_llama_tied: Path, tiny_qwen2: Path, tiny_qwen3: Path, tiny_llama3_rope: Path
) -> None:
    tied = AutoModelForCausalLM.from_pretrained(tiny_llama_tied)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert tied.model.layers[0].self_attn.o_proj.bias is not None
    qwen2_attn = AutoModelForCausalLM.from_pretrained(tiny_qwen2).model.layers[0].self_attn
    assert qwen2_attn.q_proj.bias is not None and qwen2_attn.o_proj.bias is None
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    assert qwen3.config.head_dim == 32 and qwen3.model.layers[0].self_attn.q_proj.out_features == 128
    assert hasattr(qwen3.model.layers[0].self_attn, "q_norm")
    rope = json.loads((tiny_llama3_rope / "config.json").read_text())
    assert rope["rope_scaling"]["rope_type"] == "llama3" and rope["rope_theta"] == 10000.0
    assert AutoConfig.from_pretrained(tiny_llama3_rope).rope_parameters["factor"] == 8.0


def test_sharded_checkpoint_matches_single_file(
    tiny_llama: Path, tiny_llama_sharded: Path, prompts_token_ids: list[list[int]]
) -> None:
    index = json.loads((tiny_llama_sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tiny_llama_sharded / "model.safetensors").exists()
    prompts = prompts_token_ids[:3]
    assert hf_greedy(tiny_llama_sharded, prompts, 8) == hf_greedy(tiny_llama, prompts, 8)


def test_rope_scaling_changes_output(
    tiny_llama: Path, tiny_llama3_rope: Path, prompts_token_ids: list[list[int]]
) -> None:
    """An engine that ignored rope_scaling would reproduce tiny_llama's tokens instead."""
    prompts = prompts_token_ids[-3:]
    assert hf_greedy(tiny_llama3_rope, prompts, 16) != hf_greedy(tiny_llama, prompts, 16)


def test_hf_greedy_ignores_eos(
    tiny_llama: Path, tmp_path: Path, prompts_token_ids: list[list[int]]
) -> None:
    """Every token id is an EOS here, yet exactly max_new_tokens still come back."""
    model_dir = Path(shutil.copytree(tiny_llama, tmp_path / "all_eos"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = list(range(vocab))
        (model_dir / name).write_text(json.dumps(cfg))
    prompts = prompts_token_ids[:2]
    assert hf_greedy(model_dir, prompts, 16) == hf_greedy(tiny_llama, prompts, 16)


def test_hf_logits_agree_with_greedy(tiny_qwen3: Path, prompts_token_ids: list[list[int]]) -> None:
    prompt = prompts_token_ids[2]
    (new_tokens,) = hf_greedy(tiny_qwen3, [prompt], 10)
    logits = hf_logits(tiny_qwen3, prompt + new_tokens)
    assert logits.dtype == torch.float32 and logits.shape == (len(prompt) + 10, 1000)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == new_tokens
