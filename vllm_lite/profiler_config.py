"""vLLM's profiler settings (`--profiler-config`, `LLM(profiler_config=...)`): what
`start_profile` / `stop_profile` record. The torch profiler on every worker rank (and, for an
`AsyncLLM` / the API server, in the client process), each writing a Chrome trace
(`<name>.<time>.pt.trace.json[.gz]`, TensorBoard's handler) and a table of the operators'
own CPU time (`<name>.profiler_out.txt`) into `torch_profiler_dir`. vLLM's CUDA (nsys) and
Triton Proton profilers are refused by name, as are the fields only they read.

Torch-free: the engine configuration checks it before any process starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

PROFILERS = ("torch",)
TORCH_ACTIVITIES = ("CPU", "CUDA")
# vLLM's other profilers' fields (and the CUDA graph capture trace), taken at their defaults only
_OTHER_PROFILERS_DEFAULTS: dict[str, Any] = {
    "proton_profiler_dir": "", "proton_context": "shadow", "proton_data": "tree", "proton_backend": None,
    "proton_mode": None, "proton_hook": None, "proton_output_format": None, "proton_graph_attribution": False,
    "capture_torch_profiler": False, "detailed_trace_annotation": False,
}
_PREFIX_PUNCTUATION = "._-"


@dataclass(frozen=True, slots=True)
class ProfilerConfig:
    profiler: str | None = None  # "torch", or None: start_profile is refused
    torch_profiler_dir: str = ""  # made absolute (`~` expanded), as vLLM makes it
    torch_profiler_activities: tuple[str, ...] | None = None  # None: CPU (and CUDA on a GPU)
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    # the operator table vLLM writes with device activities (its CPU table is written either way)
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    ignore_frontend: bool = False  # no trace of the client process (AsyncLLM / the API server)
    delay_iterations: int = 0  # engine steps after start_profile before recording starts
    max_iterations: int = 0  # steps recorded before the profiler stops by itself (0: no limit)
    # torch.profiler.schedule: with warmup or wait steps, recording runs wait / warmup / active steps
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    @property
    def enabled(self) -> bool:
        return self.profiler is not None

    @property
    def profiles_frontend(self) -> bool:
        activities = self.torch_profiler_activities
        return self.enabled and not self.ignore_frontend and (activities is None or "CPU" in activities)

    def activities(self, device: str) -> tuple[str, ...]:
        if self.torch_profiler_activities is not None:
            return self.torch_profiler_activities
        return ("CPU", "CUDA") if device == "cuda" else ("CPU",)


def profiler_config(given: Any, device: str) -> ProfilerConfig:
    """vLLM's ProfilerConfig dict, checked as vLLM checks it; ValueError naming what is wrong or
    not implemented."""
    if given is None:
        return ProfilerConfig()
    if isinstance(given, ProfilerConfig):
        return given
    if not isinstance(given, dict):
        raise ValueError(f"profiler_config must be a dict (vLLM's ProfilerConfig fields), got {type(given).__name__}")
    known = {f.name for f in fields(ProfilerConfig)}
    unknown = sorted(set(given) - known - set(_OTHER_PROFILERS_DEFAULTS))
    if unknown:
        raise ValueError(f"profiler_config: {', '.join(map(repr, unknown))} not implemented")
    others = [name for name, default in _OTHER_PROFILERS_DEFAULTS.items() if given.get(name, default) != default]
    if others:
        raise ValueError(f"profiler_config: {', '.join(others)}: only the torch profiler is implemented here")
    profiler = given.get("profiler")
    if profiler is not None and profiler not in PROFILERS:
        raise ValueError(f"profiler_config: profiler={profiler!r} is not implemented (implemented: "
                         f"{', '.join(PROFILERS)}; vLLM's 'cuda' and 'proton' profile GPUs)")
    config = ProfilerConfig(**{name: value for name, value in given.items() if name in known})
    _check_fields(config, device)
    directory = config.torch_profiler_dir
    if profiler == "torch" and "://" not in directory:
        directory = os.path.abspath(os.path.expanduser(directory))
    activities = config.torch_profiler_activities
    return replace(config, torch_profiler_dir=directory,
                   torch_profiler_activities=tuple(activities) if activities is not None else None)


def _check_fields(config: ProfilerConfig, device: str) -> None:
    torch = config.profiler == "torch"
    if config.torch_profiler_dir and not torch:
        raise ValueError("profiler_config: torch_profiler_dir is only applicable when profiler is set to 'torch'")
    if torch and not config.torch_profiler_dir:
        raise ValueError("profiler_config: torch_profiler_dir must be set when profiler is 'torch'")
    if torch and "://" in config.torch_profiler_dir:
        raise ValueError(f"profiler_config: torch_profiler_dir={config.torch_profiler_dir!r}: only a local "
                         "folder is implemented (vLLM's remote URIs are not)")
    activities = config.torch_profiler_activities
    if activities is not None:
        if not torch:
            raise ValueError("profiler_config: torch_profiler_activities is only applicable when profiler is set "
                             "to 'torch'")
        allowed = ("CPU", "CUDA") if device == "cuda" else ("CPU",)
        if not activities or len(set(activities)) != len(activities) or not set(activities) <= set(allowed):
            raise ValueError(f"profiler_config: torch_profiler_activities={list(activities)!r}: distinct values of "
                             f"{', '.join(allowed)} on this device ({device})")
    for name in ("delay_iterations", "max_iterations", "warmup_iterations", "wait_iterations"):
        _check_count(name, getattr(config, name), 0)
    _check_count("active_iterations", config.active_iterations, 1)


def _check_count(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"profiler_config: {name} must be an integer >= {least}, got {value!r}")


def check_profile_session(profile_prefix: str | None, delay_iterations: int | None,
                          max_iterations: int | None) -> None:
    """vLLM's checks of one start_profile call's overrides (ValueError)."""
    if profile_prefix is not None and not (
            isinstance(profile_prefix, str) and 1 <= len(profile_prefix) <= 128 and profile_prefix.isascii()
            and profile_prefix[0].isalnum()
            and all(c.isalnum() or c in _PREFIX_PUNCTUATION for c in profile_prefix[1:])):
        raise ValueError("profile_prefix must be 1-128 ASCII characters, start with a letter or number, and "
                         "contain only letters, numbers, '.', '_', or '-'")
    for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be greater than or equal to 0")


NOT_ENABLED = ("Profiling is not enabled. Please set --profiler-config to enable profiling. Example: "
               "'--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=YOUR_DIR_PATH_TO_DUMP_TRACE'")
