"""Pick the attention backend for a device: the `attention_backend` engine argument, resolved.

| name       | device | what runs                                                          |
|------------|--------|--------------------------------------------------------------------|
| auto       | cuda   | triton (torch if triton is missing)                                 |
| auto       | cpu    | cpu_native when vllm_lite._C is built and the dtype is float32 or bfloat16, else torch |
| torch      | any    | the reference: SDPA over gathered blocks                            |
| triton     | cuda   | Triton kernels (CPU only under TRITON_INTERPRET=1, for tests)       |
| cpu_native | cpu    | csrc ops; falls back to torch (with a warning) when unavailable     |
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from vllm_lite.attention.backend import AttentionBackend
from vllm_lite import _custom_ops as cpu_native
from vllm_lite.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

CPU_NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the csrc decode kernel reads


def get_attn_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if name == "auto":
        name = _auto_backend(device, dtype)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1)")
        from vllm_lite.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu_native":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu_native' runs on CPU only, not {device.type}")
        if cpu_native.is_available() and dtype in CPU_NATIVE_DTYPES:
            from vllm_lite.attention.cpu_native_backend import CpuNativeAttentionBackend

            return CpuNativeAttentionBackend()
        logger.warning("attention_backend='cpu_native': %s; using the torch backend",
                       "vllm_lite._C is not built" if dtype in CPU_NATIVE_DTYPES
                       else f"{dtype} is not float32 or bfloat16")
        return TorchAttentionBackend()
    if name != "torch":
        raise ValueError(f"unknown attention_backend {name!r}")
    return TorchAttentionBackend()


def _auto_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    return "cpu_native" if cpu_native.is_available() and dtype in CPU_NATIVE_DTYPES else "torch"
