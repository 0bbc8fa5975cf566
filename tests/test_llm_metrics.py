"""vLLM's `disable_log_stats=False` outside the server: LLM's periodic stats line and
`get_metrics()` (vLLM's reader types, counted over the LLM's own requests), an application's
AsyncLLM's `do_log_stats()`, and the reader over a registry."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram

from vllm_lite import LLM, AsyncEngineArgs, AsyncLLM, SamplingParams
from vllm_lite.metrics_reader import Counter, Gauge, Histogram, snapshot

STATS_LINE = "Avg generation throughput"


def _by_name(metrics: list, name: str) -> list:
    return [m for m in metrics if m.name == name]


def test_llm_keeps_vllms_metrics_with_disable_log_stats_false(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.001")
    llm = LLM(str(tiny_llama), max_model_len=64, dtype="float32", multiprocess=False, disable_log_stats=False)
    try:
        prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
        params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                  SamplingParams(temperature=1.0, max_tokens=4, n=3, ignore_eos=True, seed=1)]
        with caplog.at_level(logging.INFO, logger="vllm_lite.engine.stats_log"):
            outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(output.metrics is not None for output in outputs)
        assert any(STATS_LINE in record.getMessage() for record in caplog.records)
        metrics = llm.get_metrics()
        assert all(m.name.startswith("vllm:") for m in metrics)
        generated = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        (generation_tokens,) = _by_name(metrics, "vllm:generation_tokens")
        assert isinstance(generation_tokens, Counter) and generation_tokens.value == generated == 6 + 3 * 4
        (prompt_tokens,) = _by_name(metrics, "vllm:prompt_tokens")
        assert prompt_tokens.value == 3 + 3 * 2  # each of n samples is an engine request, as in vLLM
        successes = {m.labels["finished_reason"]: m.value for m in _by_name(metrics, "vllm:request_success")}
        assert successes == {"stop": 0, "length": 4, "abort": 0, "error": 0, "repetition": 0}  # vLLM's, from 0
        by_source = {m.labels["source"]: m.value for m in _by_name(metrics, "vllm:prompt_tokens_by_source")}
        assert by_source == {"local_compute": 3 + 3 * 2, "local_cache_hit": 0, "external_kv_transfer": 0}
        (most,) = _by_name(metrics, "vllm:request_max_num_generation_tokens")
        assert (most.count, most.sum) == (2, 6 + 4)  # once per request: the most one of its n generated
        (computed,) = _by_name(metrics, "vllm:request_prefill_kv_computed_tokens")
        assert (computed.count, computed.sum) == (4, 3 + 3 * 2)
        # vLLM's labels: the engine (data-parallel rank) on every per-engine metric
        per_engine = [m for m in metrics if m.name not in ("vllm:admission_rejections", "vllm:lora_requests_info")]
        assert {m.labels.get("engine") for m in per_engine} == {"0"}
        (ttft,) = _by_name(metrics, "vllm:time_to_first_token_seconds")
        assert isinstance(ttft, Histogram) and ttft.count == 4 and ttft.buckets["+Inf"] == 4 and ttft.sum > 0
        (n_param,) = _by_name(metrics, "vllm:request_params_n")
        assert (n_param.count, n_param.sum) == (2, 4.0)  # once per request: n=1 and n=3
        (max_tokens,) = _by_name(metrics, "vllm:request_params_max_tokens")
        assert (max_tokens.count, max_tokens.sum) == (4, 6 + 3 * 4)
        (e2e,) = _by_name(metrics, "vllm:e2e_request_latency_seconds")
        assert e2e.count == 4 and e2e.sum >= ttft.sum
        (running,) = _by_name(metrics, "vllm:num_requests_running")
        assert isinstance(running, Gauge) and running.value == 0
        (cache_info,) = _by_name(metrics, "vllm:cache_config_info")
        assert int(cache_info.labels["num_gpu_blocks"]) > 0
        assert _by_name(llm.get_metrics(), "vllm:generation_tokens")[0].value == generated  # a snapshot, not a reset
    finally:
        llm.shutdown()


def test_llm_keeps_no_stats_by_default_and_says_so(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.001")
    for disable_log_stats in (None, True):
        extra = {} if disable_log_stats is None else {"disable_log_stats": disable_log_stats}
        llm = LLM(str(tiny_llama), max_model_len=64, dtype="float32", multiprocess=False, **extra)
        try:
            with caplog.at_level(logging.INFO):
                outputs = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=4), use_tqdm=False)
            assert outputs[0].metrics is not None  # per-request timings either way, as vLLM's
            with pytest.raises(RuntimeError, match="disable_log_stats=False"):
                llm.get_metrics()
        finally:
            llm.shutdown()
    assert not any(STATS_LINE in record.getMessage() for record in caplog.records)


def test_async_llm_writes_the_stats_line_on_do_log_stats(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's AsyncEngineArgs default keeps the stats (the server calls do_log_stats() on a
    timer); disable_log_stats=True turns them off, and do_log_stats() then writes nothing."""

    async def run(engine: AsyncLLM) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r"):
            pass
        await engine.do_log_stats()

    lines = {}
    for disable_log_stats in (None, False, True):
        args = AsyncEngineArgs(model=str(tiny_llama), max_model_len=64, dtype="float32",
                               **({} if disable_log_stats is None else {"disable_log_stats": disable_log_stats}))
        engine = AsyncLLM.from_engine_args(args)
        try:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="vllm_lite.engine.stats_log"):
                asyncio.run(run(engine))
            lines[disable_log_stats] = [r.getMessage() for r in caplog.records if STATS_LINE in r.getMessage()]
            assert engine.log_stats is (disable_log_stats is not True)
        finally:
            engine.shutdown()
    assert len(lines[None]) == len(lines[False]) == 1 and lines[True] == []
    assert "Running: 0 reqs" in lines[False][0] and "Avg generation throughput: 0.0" not in lines[False][0]


def test_the_reader_reads_each_label_set_of_a_histogram_and_skips_other_prefixes() -> None:
    registry = CollectorRegistry()
    histogram = PromHistogram("vllm:latency_seconds", "", ["model_name"], buckets=(0.5, 1.0), registry=registry)
    histogram.labels("a").observe(0.2)
    histogram.labels("a").observe(0.7)
    histogram.labels("b").observe(3.0)
    PromCounter("vllm:things", "", registry=registry).inc(3)
    PromCounter("vllm_lite:other", "", registry=registry).inc()
    metrics = snapshot(registry)
    assert [m.name for m in metrics] == ["vllm:latency_seconds", "vllm:latency_seconds", "vllm:things"]
    a, b, things = metrics
    assert a.labels == {"model_name": "a"} and a.buckets == {"0.5": 1, "1.0": 2, "+Inf": 2}
    assert (a.count, a.sum) == (2, pytest.approx(0.9))
    assert b.buckets == {"0.5": 0, "1.0": 0, "+Inf": 1} and (b.count, b.sum) == (1, 3.0)
    assert isinstance(things, Counter) and things.value == 3
