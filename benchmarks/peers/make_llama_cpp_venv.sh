#!/usr/bin/env bash
# Builds the llama.cpp peer environment for benchmarks/gguf_decode.py: llama-cpp-python compiled
# from its sdist (CPU only) in its own virtual environment. Usage:
#   bash benchmarks/peers/make_llama_cpp_venv.sh [VENV_DIR]
# Needs cmake and a C/C++ compiler. The build compiles llama.cpp, ggml and its mtmd tools (about an
# hour on 2 cores shared with other work); CMAKE_BUILD_PARALLEL_LEVEL sets its jobs. GGML_NATIVE
# builds for this CPU (AVX-512, VNNI, bf16); CMAKE_ARGS replaces the flags below.
set -euo pipefail
VENV_DIR="${1:-$(dirname "$0")/.venv-llama-cpp}"
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

test -x "$VENV_DIR/bin/python" || "$PYTHON" -m venv "$VENV_DIR"
PY="$VENV_DIR/bin/python"
"$PY" -m pip install -q --upgrade pip
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
"$PY" -m pip install -q --no-binary llama-cpp-python numpy "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
"$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'ready in', '$VENV_DIR')"
