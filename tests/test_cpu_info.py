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


@pytest.mark.parametrize("fast", [True, False])
def test_float16_warns_where_its_matmuls_are_slow(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture, fast: bool) -> None:
    monkeypatch.setattr(cpu_info, "has_fast_fp16_matmul", lambda: fast)
    with caplog.at_level("WARNING", logger="vllm_lite.config"):
        config = EngineArgs(model=str(tiny_llama), device="cpu", dtype="half").create_engine_config()
    assert config.model_config.dtype == "float16"  # still honoured: correct, only slow
    warned = [r.getMessage() for r in caplog.records if "dtype='float16' on a CPU without AMX-FP16" in r.getMessage()]
    assert len(warned) == (0 if fast else 1)


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


def _allowed_cpus(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def test_threads_bind_confines_the_engine_core_to_its_cpus(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND naming one CPU: the spawned engine core (tensor parallel 1:
    it runs the model) runs there, and generates what an unbound engine does."""
    from vllm_lite import LLM, SamplingParams

    cpu = max(os.sched_getaffinity(0))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    unbound = LLM(str(tiny_llama), dtype="float32", max_model_len=64, multiprocess=False)
    try:
        expected = unbound.generate(["The river"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        unbound.shutdown()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cpu))
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    try:
        engine_core = llm.llm_engine.engine_core.resources.procs[0]
        assert _allowed_cpus(engine_core.pid) == str(cpu)
        assert _allowed_cpus(os.getpid()) != str(cpu) or len(os.sched_getaffinity(0)) == 1  # (this process: unbound)
        assert llm.generate(["The river"], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("value", "tensor_parallel_size", "message"), [
    ("0|0", 1, "gives 2 CPU list(s)"),
    ("0", 2, "gives 1 CPU list(s)"),
    ("4096", 1, "names CPU(s) [4096] that this process may not run on"),
    ("0,0", 1, "names a CPU twice"),
    ("first", 1, "'first' in 'first' is not a CPU id"),
])
def test_threads_bind_that_cannot_be_followed_is_refused(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                          value: str, tensor_parallel_size: int, message: str) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND") as refused:
        EngineArgs(model=str(tiny_llama), device="cpu", tensor_parallel_size=tensor_parallel_size).create_engine_config()
    assert message in str(refused.value)


def test_threads_bind_needs_the_engine_core_in_its_own_process(tiny_llama: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lite import LLM

    for value in ("auto", "nobind"):  # vllm_lite's own choice: no binding asked for
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", value)
        LLM(str(tiny_llama), dtype="float32", max_model_len=64, multiprocess=False).shutdown()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(ValueError, match="binds the process that runs the model, and with multiprocess=False"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=64, multiprocess=False)


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float", "float32"), ("float16", "float16")])
def test_vllms_dtype_spellings(tiny_llama: Path, given: str, dtype: str) -> None:
    """vLLM's --dtype choices include `half` (float16) and `float` (float32): the same dtypes here."""
    assert EngineArgs(model=str(tiny_llama), device="cpu", dtype=given).create_engine_config().model_config.dtype == dtype
    with pytest.raises(ValueError, match=r"dtype must be one of .* \(or vLLM's half, float\), got 'fp16'"):
        EngineArgs(model=str(tiny_llama), device="cpu", dtype="fp16").create_engine_config()
