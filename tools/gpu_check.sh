#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU, run the tests that exercise the CUDA path
# (token parity in fp32 with transformers for every family, async scheduling, structured outputs,
# Triton kernels compiled for the GPU, CUDA graphs, reduced precision) on the GPU, the KV cache
# sized by gpu_memory_utilization (tools/gpu_memory_check.py), then a short bf16
# throughput run with async scheduling and CUDA graphs on and off. Writes gpu_check.log,
# gpu_throughput.log and gpu_check_summary.txt into $GPU_CHECK_OUT (default .); GPU_CHECK_MODES picks
# the throughput modes (default all four). tools/gpu_wheels.sh
# fetches the wheels a bare CUDA image lacks.
# Whoever next has a GPU runs it first; RESULTS.md "GPU" keeps what it printed. The tests run one
# at a time: each engine takes gpu_memory_utilization's share of the one GPU (pytest-xdist's
# parallel engines refuse to start, by design). Tensor-parallel cases skip on a one-GPU machine.
set -uo pipefail
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-.}
REQUESTS=${GPU_CHECK_REQUESTS:-128}
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
nvidia-smi -L
timeout "${GPU_CHECK_TEST_SECONDS:-480}" $PY -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_parity.py tests/engine/test_async_scheduling.py tests/attention/test_triton_kernels.py \
    tests/attention/test_sliding_window_kernels.py tests/worker/test_cuda_graph.py tests/test_reduced_precision.py \
    tests/test_n_samples.py tests/model/test_families.py tests/test_sliding_window.py tests/sample/test_logprobs.py \
    tests/test_beam_search.py tests/sample/test_bad_words.py tests/test_embeddings.py tests/model/test_rope_scaling.py \
    tests/test_lifecycle.py tests/test_prompt_embeds.py tests/test_repetition_detection.py tests/test_lora.py \
    tests/test_speculative_decoding.py tests/test_draft_model_speculation.py tests/test_speculative_heads.py \
    tests/test_logits_processors.py \
    tests/test_thinking_budget.py tests/worker/test_decode_step_inputs.py tests/test_scheduler_knobs.py \
    tests/test_ragged.py tests/test_classification.py tests/test_gpu_memory_utilization.py \
    tests/test_fp8_checkpoint.py tests/test_wna16_checkpoint.py tests/test_mxfp4_checkpoint.py \
    2>&1 | tee "$OUT_DIR/gpu_check.log"
tests_rc=${PIPESTATUS[0]}
timeout 180 $PY tools/gpu_memory_check.py 2>&1 | tee "$OUT_DIR/gpu_memory.log"
memory_rc=${PIPESTATUS[0]}
MODES=${GPU_CHECK_MODES:-async sync async-eager sync-eager}
timeout "${GPU_CHECK_BENCH_SECONDS:-240}" $PY benchmarks/gpu_throughput.py --requests "$REQUESTS" \
    --input-range 100 1024 --output-range 100 1024 --modes $MODES --split 2>&1 | tee "$OUT_DIR/gpu_throughput.log"
bench_rc=${PIPESTATUS[0]}
{
    echo "gpu-check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit $(git rev-parse --short HEAD 2>/dev/null)"
    grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT_DIR/gpu_check.log"
    grep -E "^gpu_memory_utilization=" "$OUT_DIR/gpu_memory.log"
    sed -n '/^mode /,$p' "$OUT_DIR/gpu_throughput.log"
    echo "tests rc=$tests_rc, gpu_memory_utilization rc=$memory_rc, throughput rc=$bench_rc"
} | tee "$OUT_DIR/gpu_check_summary.txt"
exit $(( tests_rc != 0 || memory_rc != 0 || bench_rc != 0 ))
