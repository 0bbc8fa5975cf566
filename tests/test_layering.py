"""The package's import graph points one way (read with `ast`; nothing is imported).

Layers, highest first; a module may import its own package and any lower layer, never a
higher one nor a sibling at the same height:

    entrypoints > engine > executor > worker > model > sample | attention | distributed > core
    > base (wire/, config.py, sampling_params.py, pooling_params.py, outputs.py, the leaf modules)

And one import, in a child process: the CLI and the API server come up without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from vllm_lite.config import torch_built_for_gpus

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_lite"

LAYERS: dict[str, int] = {
    "base": 0,
    "core": 1,
    "attention": 2,
    "distributed": 2,
    "model": 3,
    "sample": 2,
    "structured_output": 2,
    "worker": 4,
    "executor": 5,
    "engine": 6,
    "entrypoints": 7,
    "__init__": 8,  # the public API re-exports from every layer
}
BASE_MODULES = {"wire", "lora", "logits_processor", "config", "sampling_params", "pooling_params", "outputs", "lifecycle", "exceptions", "envs", "_C", "_bookkeeping", "bookkeeping", "_custom_ops", "gguf_convert", "version",
                "config_fields", "hub", "cpu_info", "ragged", "host_to_device", "metrics_reader", "reasoning_tags",
                "multimodal_checkpoints", "profiler_config", "rpc", "eagle_config", "medusa_config",
                "vision_config", "sized_lru"}


def _unit(module: str) -> str:
    """'vllm_lite.engine.core' -> 'engine'; top-level leaf modules -> 'base'."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    first = parts[1]
    if first in BASE_MODULES:
        return "base"
    return first


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, package_root: Path = PACKAGE) -> Iterator[tuple[int, str]]:
    """(line, imported vllm_lite module) for every import in the file, at any depth."""
    module = _module_name(path, package_root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vllm_lite"):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("vllm_lite"):
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    yield node.lineno, submodule if _is_module(submodule, package_root) else target


def _is_module(name: str, package_root: Path = PACKAGE) -> bool:
    path = package_root.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").exists() or any(path.parent.glob(path.name + ".*.so"))


def _modules(package_root: Path = PACKAGE) -> list[Path]:
    return sorted(package_root.rglob("*.py"))


def test_every_package_has_a_layer() -> None:
    units = {_unit(_module_name(path)) for path in _modules()}
    assert units <= set(LAYERS), f"declare a layer for: {sorted(units - set(LAYERS))}"


def _layer_violations(package_root: Path = PACKAGE) -> list[str]:
    violations = []
    for path in _modules(package_root):
        source = _unit(_module_name(path, package_root))
        for line, target in _imports(path, package_root):
            dest = _unit(target)
            if dest != source and LAYERS[dest] >= LAYERS[source]:
                violations.append(f"{path.relative_to(package_root)}:{line} ({source}) imports {target} ({dest})")
    return violations


def test_no_module_imports_a_higher_or_sibling_layer() -> None:
    violations = _layer_violations()
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_core_imports_only_the_base_layer() -> None:
    for path in (PACKAGE / "core").rglob("*.py"):
        for line, target in _imports(path):
            assert _unit(target) in ("base", "core"), f"{path.name}:{line} imports {target}"


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for path in _modules():
        graph[_module_name(path)] = {target for _, target in _imports(path)}

    def resolve(name: str) -> str | None:
        while name and name not in graph:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: {r for t in targets if (r := resolve(t)) and r != m and not m.startswith(r + ".")}
             for m, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for module in edges:
        if module not in state and (cycle := visit(module)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """Guard against a checker that cannot fail: in a fake package, core importing the engine,
    the worker importing the engine (relative import) and sample importing attention are found."""
    root = tmp_path / "vllm_lite"
    files = {
        "__init__.py": "",
        "wire/__init__.py": "",
        "core/__init__.py": "",
        "core/scheduler.py": "from vllm_lite.wire import X\nfrom vllm_lite.engine.core import EngineCore\n",
        "engine/__init__.py": "",
        "engine/core.py": "from vllm_lite.core.scheduler import Scheduler\n",
        "worker/__init__.py": "",
        "worker/worker.py": "def f():\n    from ..engine import core\n",
        "sample/__init__.py": "",
        "sample/sampler.py": "from vllm_lite.attention import ops\n",
        "attention/__init__.py": "",
        "attention/ops.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    found = "\n".join(_layer_violations(root))
    assert "core/scheduler.py:2 (core) imports vllm_lite.engine.core (engine)" in found
    assert "worker/worker.py:2 (worker) imports vllm_lite.engine" in found
    assert "sample/sampler.py:1 (sample) imports vllm_lite.attention" in found
    assert "engine/core.py" not in found and "wire" not in found


def test_the_cli_and_the_api_server_import_without_torch(tiny_qwen3: Path) -> None:
    """`vllm-lite serve` checks its options (and refuses bad ones) before anything imports torch,
    which takes seconds: an API server process (one of a pool, too) loads it only if it needs it.
    With a CPU build of torch, the engine config (device "auto" included) is made without it too,
    so `serve` starts the engine core's process first."""
    code = ("import sys, vllm_lite.entrypoints.cli, vllm_lite.entrypoints.openai.api_server; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules)); "
            "from vllm_lite.config import EngineArgs; "
            "print(EngineArgs(model=sys.argv[1]).create_engine_config().device_config.device, "
            "sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, str(tiny_qwen3)], capture_output=True, text=True,
                            timeout=120, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    imports, config = result.stdout.strip().splitlines()
    assert imports == "[]"
    if not torch_built_for_gpus():
        assert config == "cpu []"
