"""What the host CPU computes natively, read once from the kernel's CPU flags (torch-free).

`torch.backends.cpu.get_cpu_capability()` says only "AVX512" on a CPU with avx512_bf16, so the
flags are read from /proc/cpuinfo (Linux); elsewhere nothing is assumed native.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dot products in hardware
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products in hardware
FP16_MATMUL_FLAGS = ("amx_fp16",)  # fp16 matmuls in hardware (with avx512_fp16 alone: no faster than fp32)


def _cpuinfo_field(name: str, cpuinfo: Path) -> str | None:
    """The first processor's `name` line of /proc/cpuinfo, or None."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    return frozenset((_cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_summary(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and which precisions it computes natively, for benchmark headers
    (the machines a benchmark lands on differ: bf16 is emulated on CPUs without it)."""
    bf16, int8 = has_native_bf16(cpuinfo), has_native_int8(cpuinfo)
    return (f"{_cpuinfo_field('model name', cpuinfo) or 'unknown CPU'}; native bf16: {'yes' if bf16 else 'no'}, "
            f"native int8 dot products: {'yes' if int8 else 'no'}")


def has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    return any(flag in cpu_flags(cpuinfo) for flag in BF16_FLAGS)


def has_native_int8(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    return any(flag in cpu_flags(cpuinfo) for flag in INT8_FLAGS)


def has_fast_fp16_matmul(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    return any(flag in cpu_flags(cpuinfo) for flag in FP16_MATMUL_FLAGS)


def model_threads(ranks_per_node: int = 1) -> int:
    """Intra-op threads of a process that runs the model: OMP_NUM_THREADS when set, else every
    core this process may run on (its affinity mask), shared between the host's TP ranks; vLLM's
    CPU build also takes all of a node's cores by default."""
    configured = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not configured:
        return max(1, len(os.sched_getaffinity(0)) // ranks_per_node)
    first = configured.split(",")[0]  # OpenMP's nested form "outer,inner"
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {configured!r}")
    return int(first)


THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's


def bound_cpu_lists(ranks_per_node: int) -> list[list[int]] | None:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND: the CPUs each of this node's model processes (ranks, or
    the engine core when it runs the model) is bound to, one list per local rank separated by
    "|", each like "0-3,8"; None for "auto" (the default: this engine's own choice, every core the
    process may use, unpinned; vLLM's "auto" pins to a NUMA node's cores) or "nobind". A list
    that names a CPU this process may not use, or a count of lists that is not the number of
    ranks, is refused naming the variable."""
    value = os.environ.get(THREADS_BIND_ENV, "auto").strip()
    if value in ("auto", "nobind"):
        return None
    lists = [_cpu_ids(item) for item in value.split("|")]
    if len(lists) != ranks_per_node:
        raise ValueError(f"{THREADS_BIND_ENV}={value!r} gives {len(lists)} CPU list(s) ('|' between them); this "
                         f"node runs {ranks_per_node} model process(es) (tensor-parallel ranks per node): give one "
                         "list each, or 'auto' / 'nobind'")
    allowed = os.sched_getaffinity(0)
    for cpus in lists:
        outside = sorted(set(cpus) - allowed)
        if outside:
            raise ValueError(f"{THREADS_BIND_ENV}={value!r} names CPU(s) {outside} that this process may not run on "
                             f"(allowed: {','.join(map(str, sorted(allowed)))})")
    return lists


def _cpu_ids(text: str) -> list[int]:
    """"5,2-4" -> [5, 2, 3, 4] (vLLM's form); a repeated or malformed id is refused."""
    ids: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"{THREADS_BIND_ENV}: {part.strip()!r} in {text!r} is not a CPU id or a range like 2-4")
        ids += range(int(low), int(high if dash else low) + 1)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{THREADS_BIND_ENV}: {text!r} names a CPU twice")
    return ids


def bind_model_threads(local_rank: int, ranks_per_node: int) -> int:
    """For a process about to run the model: binds it to its VLLM_CPU_OMP_THREADS_BIND list (its
    threads, OpenMP's included, run on those CPUs only) and returns the intra-op thread count,
    one per CPU (vLLM's rule: over OMP_NUM_THREADS); without a list, `model_threads`."""
    lists = bound_cpu_lists(ranks_per_node)
    if lists is None:
        return model_threads(ranks_per_node)
    os.sched_setaffinity(0, lists[local_rank])
    return len(lists[local_rank])


# OpenMP settings a spawned engine-core or worker process starts with, unless the user's
# environment sets them. libgomp reads them once, when torch loads it, so they must be in the
# child's environment before its first `import torch`. PASSIVE: a thread waiting for work sleeps
# instead of spinning (GOMP's default spins ~300k iterations first); with another process busy
# on the same cores, spinning threads steal the time the working thread needs. No pinning here:
# OMP_PROC_BIND / GOMP_CPU_AFFINITY pin threads when the user sets them.
# Measured (benchmarks/RESULTS.md, issue 15): on a quiet machine PASSIVE cost the unfused fp32
# model ~40% against spinning (60 s vs 42 s), while with one busy process beside it spinning
# collapsed (141 s vs 78 s). The fused layer ops leave no OpenMP region at decode sizes outside the
# matmuls and attention, which shrinks what PASSIVE costs; a bounded spin did not beat it under
# load (GOMP_SPINCOUNT=2000: 75 s vs 73 s; 10,000: 246 s at load 18), so PASSIVE stays the one
# default. Quiet and with the fused build, GOMP_SPINCOUNT=2000 ties PASSIVE at 32 requests and wins
# ~25% on a single stream, but loses ~45% on that stream beside one busy process (RESULTS.md,
# "Quiet machine, all peers in one run"). GOMP_SPINCOUNT (iterations of ~0.1-0.2 us here)
# overrides PASSIVE for a dedicated machine.
OPENMP_CHILD_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def openmp_threads_sleep() -> bool:
    """Whether this process's idle OpenMP threads sleep at once (PASSIVE, no GOMP_SPINCOUNT):
    every parallel region then starts by waking them (libgomp reads these once, at start)."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ


@contextlib.contextmanager
def openmp_child_env() -> Iterator[None]:
    """Around `Process.start()` of a spawned child: OPENMP_CHILD_DEFAULTS in os.environ (which the
    child inherits) for the duration, the parent's environment restored after."""
    added = [name for name in OPENMP_CHILD_DEFAULTS if name not in os.environ]
    for name in added:
        os.environ[name] = OPENMP_CHILD_DEFAULTS[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
