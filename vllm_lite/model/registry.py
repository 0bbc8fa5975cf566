"""Architecture name (config.json `architectures[0]`) -> model class. The table itself lives
in config.py (`MODEL_ARCHITECTURES`), so configuration rejects an unknown architecture before
any worker starts without importing the model layer; classes are imported on use."""

from __future__ import annotations

import importlib

from vllm_lite.config import MODEL_ARCHITECTURES, check_supported


def get_model_class(architecture: str) -> type:
    check_supported(architecture)
    module_name, class_name = MODEL_ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)
