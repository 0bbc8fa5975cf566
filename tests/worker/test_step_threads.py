"""Small CPU steps (model_runner.ONE_THREAD_MAX_TOKENS) run on one thread when idle OpenMP threads
sleep and one thread measured faster at start; the configured count comes back for larger steps,
and nothing changes when threads spin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_lite.config import EngineArgs
from vllm_lite.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.worker.model_runner import ONE_THREAD_MAX_TOKENS, ModelRunner


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def prefill(req_ids: list[str], num_tokens: int) -> SchedulerOutput:
    new = [NewRequestData(r, np.arange(1, num_tokens + 1, dtype=np.int32), num_tokens, SamplingParams(temperature=0.0),
                          [i + 1], 0) for i, r in enumerate(req_ids)]
    return SchedulerOutput(new, CachedRequestData.empty(), {r: num_tokens for r in req_ids},
                           num_tokens * len(req_ids), frozenset(), frozenset())


def threads_after_steps(tiny_llama: Path) -> list[int]:
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, max_num_seqs=8).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.initialize_kv_cache(16)
    seen = []
    for req_ids in (["a"], ["b", "c"]):  # ONE_THREAD_MAX_TOKENS tokens, then twice as many
        output = runner.execute_model(prefill(req_ids, ONE_THREAD_MAX_TOKENS))
        assert int(output.num_sampled.sum()) == len(req_ids)  # the step ran and sampled
        seen.append(torch.get_num_threads())
    return seen


@pytest.fixture
def sleeping_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


def measured(seconds: dict[int, float]):
    def best_linear_pass_seconds(self, thread_counts):
        assert thread_counts == (1, 2)
        return seconds
    return best_linear_pass_seconds


def test_small_steps_take_one_thread_where_it_measured_faster(tiny_llama: Path, two_threads: None,
                                                              sleeping_threads: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelRunner, "_best_linear_pass_seconds", measured({1: 0.010, 2: 0.012}))
    assert threads_after_steps(tiny_llama) == [1, 2]


def test_small_steps_keep_every_thread_where_that_measured_faster(tiny_llama: Path, two_threads: None,
                                                                  sleeping_threads: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelRunner, "_best_linear_pass_seconds", measured({1: 0.012, 2: 0.010}))
    assert threads_after_steps(tiny_llama) == [2, 2]


def test_the_measurement_times_both_counts_and_restores_the_configured_one(tiny_llama: Path, two_threads: None,
                                                                           sleeping_threads: None) -> None:
    config = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, max_num_seqs=8).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"))
    best = runner._best_linear_pass_seconds((1, 2))
    assert set(best) == {1, 2} and all(0 < seconds < 1 for seconds in best.values())
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "2000"}])
def test_spinning_threads_keep_the_configured_count(tiny_llama: Path, two_threads: None,
                                                    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert threads_after_steps(tiny_llama) == [2, 2]
