"""The csrc kernels at every ISA level this CPU runs (csrc/cpu_multiversion.h).

The extension picks each kernel's vector width by the CPU (16 lanes on AVX-512, 8 on AVX2, 4
elsewhere); VLLM_LITE_CPU_CAPABILITY caps it. The kernel tests run at the host's own level with
the rest of the suite; here they run again, in a subprocess, at each lower level, so the paths a
laptop without AVX-512 (or an old CPU without AVX2) takes are tested on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_lite import _custom_ops as cpu_native
from vllm_lite.cpu_info import cpu_flags

TESTS = Path(__file__).parent
LEVELS = ("default", "avx2", "avx512")  # narrowest first
# The tests of the kernels VLLM_LITE_CPU_CAPABILITY reaches (the per-ISA ones and the int8 cache's
# AVX2 paths); the sampler's and the grammar mask's loops are target_clones picked by the CPU alone.
KERNEL_TESTS = ["attention/test_csrc_ops.py", "attention/test_kv_quant.py",
                "attention/test_sliding_window_kernels.py::test_cpu_native_backend_window",
                "model/test_layer_ops.py", "sample/test_topk_topp.py",
                "model/test_head_panels.py::test_logits_match_the_matmul",
                "model/test_head_panels.py::test_greedy_tokens_are_the_first_maximum_of_the_logits",
                "model/test_head_panels.py::test_ties_go_to_the_first_column_across_lanes_panels_and_threads",
                "model/test_head_panels.py::test_padding_past_the_vocabulary_never_wins",
                # (the int16 screen's AVX2 tiles at avx2; skipped at the baseline, which has no screen)
                "model/test_head_panels.py::test_kernels_refuse_mismatched_inputs",
                "model/test_head_panels.py::test_screened_tokens_are_greedy_heads",
                "model/test_head_panels.py::test_screened_near_ties_are_decided_by_the_fp32_logits",
                "model/test_head_panels.py::test_screened_coarse_codes_still_give_greedy_heads",
                "model/test_head_panels.py::test_screened_rows_outside_the_bound_are_computed_exactly",
                "model/test_gguf_quantized.py::test_dequantize_matches_reference",
                "model/test_gguf_quantized.py::test_gemm_matches_reference",
                "model/test_gguf_quantized.py::test_gguf_linear_both_paths_with_bias",
                "model/test_quantization.py::test_csrc_quantize_rows_equals_torch_rule",
                "model/test_quantization.py::test_csrc_quantize_rows_takes_strided_rows",
                "model/test_quantization.py::test_csrc_dequantize_int32"]

pytestmark = pytest.mark.skipif(not cpu_native.is_available(), reason="needs the csrc build")


def lower_levels() -> list[str]:
    """The levels below the host's (read at collection, so none without the csrc build)."""
    if not cpu_native.is_available():
        return []
    return list(LEVELS[:LEVELS.index(cpu_native.cpu_capability())])


def capability_in_subprocess(value: str) -> subprocess.CompletedProcess:
    code = "from vllm_lite import _custom_ops as c; c.is_available(); print(c.cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "VLLM_LITE_CPU_CAPABILITY": value},
                          capture_output=True, text=True, timeout=120)


def test_the_host_level_is_the_widest_the_cpu_has() -> None:
    assert cpu_native.cpu_capability() in LEVELS
    assert capability_in_subprocess("").stdout.strip() == cpu_native.cpu_capability()


@pytest.mark.parametrize("level", LEVELS)
def test_capability_caps_the_level(level: str) -> None:
    host = LEVELS.index(cpu_native.cpu_capability())
    expected = LEVELS[min(LEVELS.index(level), host)]
    result = capability_in_subprocess(level)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("level", LEVELS)
def test_the_head_screen_runs_on_avx2_and_on_avx512_with_vnni(level: str) -> None:
    """The LM head's int16 screen: vpmaddwd tiles where AVX2 is the level, vpdpwssd ones on
    AVX-512 with VNNI; none at the baseline level or on AVX-512 without VNNI."""
    code = "from vllm_lite import _custom_ops as c; c.is_available(); print(c.cpu_capability(), c.head_screen_supported())"
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VLLM_LITE_CPU_CAPABILITY": level},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    capability, supported = result.stdout.split()
    expected = {"default": False, "avx2": True, "avx512": "avx512_vnni" in cpu_flags()}[capability]
    assert supported == str(expected)


def test_an_unknown_capability_is_refused_by_name() -> None:
    result = capability_in_subprocess("sse4")
    assert result.returncode != 0
    assert "VLLM_LITE_CPU_CAPABILITY=sse4 is not one of avx512, avx2, default" in result.stderr


@pytest.mark.parametrize("level", lower_levels())
def test_kernels_at_a_lower_level(level: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[str(TESTS / t) for t in KERNEL_TESTS]],
        env={**os.environ, "VLLM_LITE_CPU_CAPABILITY": level}, capture_output=True, text=True, timeout=600,
        cwd=TESTS.parent)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
