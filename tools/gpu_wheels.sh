#!/usr/bin/env bash
# Downloads, into ./.whl, the wheels that `make gpu-check` needs beyond what a CUDA machine's
# image usually has (torch, triton, transformers, tokenizers, safetensors): pyzmq, msgspec and
# xgrammar with its pydantic and tvm-ffi. The versions are this checkout's venv's; PY_VERSION is the
# GPU machine's Python (3.12 on the lent H200/H100 image). On the GPU machine:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site make gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
packages=()
for name in pyzmq msgspec xgrammar pydantic pydantic_core annotated-types typing-inspection apache-tvm-ffi; do
    packages+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${packages[@]}"
ls .whl
