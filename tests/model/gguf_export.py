"""Write a tiny Hugging Face checkpoint as a GGUF file (fp32 tensors, llama.cpp's tensor names
and metadata keys, a `gpt2` BPE tokenizer), for tests of GGUF loading beyond the demo model.

`llama` files get llama.cpp's q/k row permutation, as its converter writes them (our loader undoes
it). Matrices can be stored as Q8_0 or Q4_1 blocks (`quantize_q4_1` writes llama.cpp's layout)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def export_gguf(model_dir: Path, out_path: Path, arch: str, quantize_q8: bool = False,
                quant: str | None = None) -> Path:
    """`quant` ("Q8_0" or "Q4_1"): matrices whose rows are whole 32-value blocks stored in that
    format; `quantize_q8` is `quant="Q8_0"`."""
    import gguf
    from safetensors.numpy import load_file

    quant = "Q8_0" if quantize_q8 else quant
    cfg = json.loads((model_dir / "config.json").read_text())
    model_arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                  "mistral": gguf.MODEL_ARCH.LLAMA, "llama": gguf.MODEL_ARCH.LLAMA}[arch]
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    _add_tokenizer(writer, model_dir, "default" if arch == "llama" else "qwen2")
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = np.ascontiguousarray(tensor, dtype=np.float32)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"]
            data = permute_rotary_rows(data, heads)
        if quant and data.ndim == 2 and data.shape[1] % 32 == 0:
            qtype = getattr(gguf.GGMLQuantizationType, quant)
            blocks = quantize_q4_1(data) if quant == "Q4_1" else gguf.quants.quantize(data, qtype)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def permute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from [first half | second half] to interleaved."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def quantize_q4_1(data: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1 (quantize_row_q4_1_ref): per block of 32, d = (max - min) / 15, m = min,
    q = round((x - min) / d) in [0, 15]; fp16 d, fp16 m, then 16 bytes whose low nibbles hold
    values 0-15 and high nibbles 16-31. Returns uint8 [rows, blocks * 20]."""
    rows, cols = data.shape
    x = data.reshape(rows, cols // 32, 32).astype(np.float32)
    low, high = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    d = (high - low) / 15.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.floor((x - low) * inv + 0.5), 0, 15).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    head = np.concatenate([d.astype(np.float16), low.astype(np.float16)], axis=-1).view(np.uint8)
    return np.concatenate([head, nibbles], axis=-1).reshape(rows, -1)


def _add_tokenizer(writer, model_dir: Path, pre: str) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted({**vocab, **added}.items(), key=lambda item: item[1])
    assert [i for _, i in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in tokens])
    writer.add_token_types([3 if t in added else 1 for t, _ in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
