"""Write a tiny Hugging Face checkpoint as a GGUF file (fp32 tensors, llama.cpp's tensor names
and metadata keys, a `gpt2` BPE tokenizer), for tests of GGUF loading beyond the demo model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def export_gguf(model_dir: Path, out_path: Path, arch: str, quantize_q8: bool = False) -> Path:
    """`quantize_q8`: matrices stored as Q8_0 (blocks of 32 int8 values with one scale)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    model_arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                  "mistral": gguf.MODEL_ARCH.LLAMA}[arch]
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
    _add_tokenizer(writer, model_dir)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = np.ascontiguousarray(tensor, dtype=np.float32)
        if quantize_q8 and data.ndim == 2 and data.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_tokenizer(writer, model_dir: Path) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted({**vocab, **added}.items(), key=lambda item: item[1])
    assert [i for _, i in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([t for t, _ in tokens])
    writer.add_token_types([3 if t in added else 1 for t, _ in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
