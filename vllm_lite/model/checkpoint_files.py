"""A checkpoint folder's safetensors files and their tensors, read lazily (the loader and the
Transformers fallback's multimodal path both read them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open


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
