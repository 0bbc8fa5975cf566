"""CPU feature detection, dtype="auto" on CPU, and the OpenMP environment of spawned processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_lite import cpu_info
from vllm_lite.config import EngineArgs


def test_cpu_flags_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n")
    assert {"avx512_bf16", "avx512_vnni", "fpu"} <= cpu_info.cpu_flags(info)
    assert cpu_info.cpu_flags(tmp_path / "missing") == frozenset()


def test_cpu_summary_names_model_and_native_precisions(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor @ 2.50GHz\n"
                    "flags\t\t: fpu avx512f avx512_vnni\n")
    assert cpu_info.cpu_summary(info) == ("Intel(R) Xeon(R) Processor @ 2.50GHz; native bf16: no, "
                                          "native int8 dot products: yes")
    assert cpu_info.cpu_summary(tmp_path / "missing").startswith("unknown CPU; native bf16: no")


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_on_cpu_follows_native_bf16(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                               native: bool, expected: str) -> None:
    monkeypatch.setattr(cpu_info, "has_native_bf16", lambda: native)
    config = EngineArgs(model=str(tiny_llama), device="cpu").create_engine_config()
    assert config.model_config.dtype == expected
    explicit = EngineArgs(model=str(tiny_llama), device="cpu", dtype="float32").create_engine_config()
    assert explicit.model_config.dtype == "float32"


@pytest.mark.parametrize("native", [True, False])
def test_int8_quantization_warns_where_int8_is_emulated(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture, native: bool) -> None:
    monkeypatch.setattr(cpu_info, "has_native_int8", lambda: native)
    with caplog.at_level("WARNING", logger="vllm_lite.config"):
        config = EngineArgs(model=str(tiny_llama), device="cpu", dtype="float32",
                            quantization="int8").create_engine_config()
    assert config.model_config.quantization == "int8"  # still honoured: correct, only slow
    warned = [r.getMessage() for r in caplog.records if "without int8 dot products" in r.getMessage()]
    assert len(warned) == (0 if native else 1)


def test_openmp_child_env_sets_defaults_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with cpu_info.openmp_child_env():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    with cpu_info.openmp_child_env():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_model_threads_default_to_every_allowed_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert cpu_info.model_threads() == 8
    assert cpu_info.model_threads(ranks_per_node=2) == 4
    assert cpu_info.model_threads(ranks_per_node=16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_info.model_threads() == 3 and cpu_info.model_threads(ranks_per_node=2) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2,1")  # OpenMP's nested form: the outer level
    assert cpu_info.model_threads() == 2
    for bad in ("0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            cpu_info.model_threads()
