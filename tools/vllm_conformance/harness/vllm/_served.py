"""What the stubs answer from: the demo model folder and the version of the server under test."""

from __future__ import annotations

import json
import os
import re
import subprocess

from tests.utils import target


def model_dir() -> str:
    return target().model_dir


def vocab_size() -> int:
    with open(f"{model_dir()}/config.json") as f:
        return int(json.load(f)["vocab_size"])


def server_version() -> str:
    """The version the server under test reports on /version (read without importing its API)."""
    t = target()
    if t.name == "vllm":
        code = "import importlib.util as u; print(open(u.find_spec('vllm').submodule_search_locations[0] + '/_version.py').read())"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the harness's vllm/ is a stub
        source = subprocess.run([t.vllm_python, "-c", code], capture_output=True, text=True, check=True,
                                env=env, cwd="/").stdout  # nor the working folder, which holds them
    else:
        code = "import vllm_lite.version as v; print(open(v.__file__).read())"
        source = subprocess.run([t.vllm_lite_python, "-c", code], capture_output=True, text=True,
                                check=True).stdout
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", source)
    if match is None:
        raise RuntimeError("no __version__ found for the server under test")
    return match.group(1)
