"""`vllm_lite/core/` is pure Python + numpy: importing it must not import torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import vllm_lite


def test_core_imports_no_torch() -> None:
    core_dir = Path(vllm_lite.__file__).parent / "core"
    modules = [f"vllm_lite.core.{m.name}" for m in pkgutil.iter_modules([str(core_dir)])]
    assert "vllm_lite.core.scheduler" in modules
    code = "\n".join([
        "import importlib, sys",
        f"for name in {modules!r}: importlib.import_module(name)",
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))",
        "print(bad)",
        "sys.exit(1 if bad else 0)",
    ])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"torch imported by vllm_lite.core: {result.stdout} {result.stderr}"
