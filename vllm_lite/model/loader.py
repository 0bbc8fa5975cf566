"""Build a model from a Hugging Face folder: safetensors (single file or sharded index), mapped
onto fused parameters through each parameter's `weight_loader`; each rank reads only its slice."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite.config import ModelConfig
from vllm_lite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vllm_lite.model.layers.quantization import quantize_model
from vllm_lite.model.registry import get_model_class

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors weights in '{model_dir}'")
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs: a weight loader reads just the part its rank needs."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    split = getattr(model, "split_checkpoint_tensor", None)
    for name, weight in _split_fused(iterate_weights(model_dir), split):
        if name.endswith(_SKIPPED_SUFFIXES) or (tied and name.startswith("lm_head.")):
            continue
        target, shard_id = _map_name(model, name)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        loader = getattr(param, "weight_loader", _default_loader)
        loader(param, weight, shard_id) if shard_id is not None else loader(param, weight)
        loaded.add(target)
    loaded_tensors = {id(params[n]) for n in loaded}  # a tied weight is loaded under either name
    missing = {n for n, p in params.items() if id(p) not in loaded_tensors and not (tied and n.startswith("lm_head."))}
    if missing:
        raise ValueError(f"checkpoint in '{model_dir}' lacks weights for: {sorted(missing)[:5]}")


def _split_fused(weights: Iterator[tuple[str, Any]], split: Any) -> Iterator[tuple[str, Any]]:
    """A checkpoint that fuses projections (Phi-3's qkv_proj, gate_up_proj) is read as the
    separate tensors the model's weight loaders take: `split(name, weight)` returns them, or
    None for a tensor that is not fused."""
    for name, weight in weights:
        parts = split(name, weight) if split is not None else None
        yield from parts if parts is not None else [(name, weight)]


def _map_name(model: nn.Module, name: str) -> tuple[str, Any]:
    hook = getattr(model, "map_checkpoint_name", None)
    mapped = hook(name) if hook is not None else None
    if mapped is not None:
        return mapped
    for ckpt_fragment, param_fragment, shard_id in getattr(model, "stacked_params_mapping", ()):
        if ckpt_fragment in name:
            return name.replace(ckpt_fragment, param_fragment), shard_id
    return name, None


def _default_loader(param: nn.Parameter, loaded: Any) -> None:
    param.data.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded[:])


def load_model(model_config: ModelConfig, backend: AttentionBackend, device: torch.device,
               tp: TensorParallelGroup = SINGLE_RANK) -> nn.Module:
    model_cls = get_model_class(model_config.hf.architecture, model_config.hf.model_impl)
    dtype = getattr(torch, model_config.dtype)
    if model_config.hf.model_impl == "transformers":  # transformers reads its own checkpoint
        model = model_cls(model_config.hf, Path(model_config.model), backend, tp)
    else:
        with torch.device("cpu"):
            model = model_cls(model_config.hf, model_config.max_model_len + 1, backend, tp)
        load_weights(model, Path(model_config.model))
    model = model.to(device=device, dtype=dtype).eval()
    if model_config.quantization is not None:
        quantize_model(model, model_config.quantization)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model
