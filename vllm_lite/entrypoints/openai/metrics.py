"""Prometheus metrics of one server (or of one `LLM` with disable_log_stats=False, read by its
`get_metrics()`), in a registry of its own (never the global one). A metric
vLLM also has carries vLLM's name (`vllm:` prefix), so dashboards built for vLLM find it; the
ones vLLM does not have are `vllm_lite:` (`vllm_lite:prefix_cache_hit_rate`,
`vllm_lite:request_aborted`): no `vllm:` name that vLLM lacks.

Three sources, each counted where vLLM counts it:
- the engine's own counters (`get_stats()`: running/waiting requests, KV blocks, prefix-cache
  queries and hits, preemptions, and the client's processor-cache queries and hits), read at
  scrape time by `EngineStatsCollector`;
- each engine step's IterationStats (engine/stats.py: engine-core timestamps), passed to
  `record_iteration` by AsyncLLM: tokens per step, the generated tokens' counter (once a step, as
  vLLM counts it, not once per streamed output), inter-token latency, and for finished requests
  the queue / prefill / decode / inference times and time per output token;
- what the server sees of each request's outputs (prompt tokens, time to first token, e2e
  latency, tokens per finished request, finished and aborted requests), recorded by
  `RequestTracker`; an LLM has no server, and records the same from the step's finished
  requests (`record_requests`).

In a pool of API servers (--api-server-count) the last two are summed over the pool by
prometheus_client's multiprocess mode (ServerMetrics._exposition_registry).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from vllm_lite.config import VllmConfig
from vllm_lite.engine.stats import IterationStats, SpecDecodingStats, kv_cache_usage
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import SamplingParams

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineStatsCollector:
    """Turns the engine's last `get_stats()` snapshot into gauges and counters. The /metrics
    handler refreshes the snapshot (an awaitable call) just before it renders the registry."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        queries = stats.get("prefix_cache_queries", 0)
        hits = stats.get("prefix_cache_hits", 0)
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          stats.get("num_running", 0))
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          stats.get("num_waiting", 0))
        deferred = stats.get("num_waiting_deferred", 0)
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Waiting requests by reason: "
                                      "'capacity' = waiting for room in the batch; 'deferred' = held by a "
                                      "transient constraint (a grammar still compiling). Sum of all reasons "
                                      "equals vllm:num_requests_waiting.", labels=["model_name", "reason"])
        by_reason.add_metric([self.model_name, "capacity"], stats.get("num_waiting", 0) - deferred)
        by_reason.add_metric([self.model_name, "deferred"], deferred)
        yield by_reason
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                          kv_cache_usage(stats))
        yield self._gauge("vllm_lite:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens.",
                          hits / queries if queries else 0.0)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield self._counter("vllm:num_preemptions", "Requests preempted (KV blocks ran out).",
                            stats.get("num_preemptions", 0))
        yield self._counter("vllm:mm_cache_queries", "Images looked up in this client's processor cache.",
                            stats.get("mm_cache_queries", 0))
        yield self._counter("vllm:mm_cache_hits", "Images found in this client's processor cache.",
                            stats.get("mm_cache_hits", 0))
        if "max_lora" in stats:  # an engine serving LoRA adapters: vLLM's info gauge, set to the time
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric([str(stats["max_lora"]), stats["waiting_lora_adapters"], stats["running_lora_adapters"]],
                            time.time())
            yield info

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        metric = GaugeMetricFamily(name, doc, labels=["model_name"])
        metric.add_metric([self.model_name], value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        metric = CounterMetricFamily(name, doc, labels=["model_name"])
        metric.add_metric([self.model_name], value)
        return metric


class CacheConfigCollector:
    """vllm:cache_config_info: the KV-cache configuration as labels, value 1 (a collector, not a
    Gauge, so that a pool's multiprocess files do not give one series per process)."""

    def __init__(self, cache_info: dict[str, str]) -> None:
        self.cache_info = dict(sorted(cache_info.items()))

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV-cache configuration (labels; value 1).",
                                 labels=list(self.cache_info))
        info.add_metric(list(self.cache_info.values()), 1)
        yield info


def num_speculative_tokens(vllm_config: Any) -> int:
    """The drafts a step may give a request (0: no speculative decoding), for ServerMetrics."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 0 if spec is None else spec.num_speculative_tokens


def cache_config_info(vllm_config: Any) -> dict[str, str] | None:
    """The KV-cache configuration's fields as strings (vllm:cache_config_info's labels)."""
    cache_config = getattr(vllm_config, "cache_config", None)
    if cache_config is None or not dataclasses.is_dataclass(cache_config):
        return None
    info = {f.name: str(getattr(cache_config, f.name)) for f in dataclasses.fields(cache_config)}
    if isinstance(vllm_config, VllmConfig):
        info.update(_kv_capacity_labels(vllm_config))
    return info


def _kv_capacity_labels(config: VllmConfig) -> dict[str, str]:
    """vLLM's capacity labels: the pool's blocks and tokens, and how many requests of
    max_model_len tokens it holds at once (vLLM's "Maximum concurrency", by its formula)."""
    num_blocks, block_size = config.num_kv_blocks(), config.cache_config.block_size
    blocks_per_request = -(-config.model_config.max_model_len // block_size)
    window = config.cache_config.sliding_window
    if window is not None:  # older blocks are freed: a request holds about a window's worth
        blocks_per_request = min(blocks_per_request, -(-window // block_size) + 1)
    return {"num_gpu_blocks": str(num_blocks), "kv_cache_size_tokens": str(num_blocks * block_size),
            "kv_cache_max_concurrency": f"{num_blocks / blocks_per_request:.2f}"}


def _token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


def observe_many(histogram: Histogram, values: np.ndarray) -> None:
    """`histogram.observe(v)` for every v in `values`, with one increment per bucket instead of
    one call per value (a step's inter-token latencies: one per running stream). prometheus_client
    has no batch form; this updates what its `observe` updates (`_sum`, the first bucket whose
    bound is >= the value), checked against `observe` by tests/entrypoints/test_metrics_batch.py."""
    bounds = np.asarray(histogram._upper_bounds)
    per_bucket = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    histogram._sum.inc(float(values.sum()))
    for bucket in np.flatnonzero(per_bucket).tolist():
        histogram._buckets[bucket].inc(int(per_bucket[bucket]))


class SpecDecodeMetrics:
    """vLLM's speculative decoding counters: drafts (requests that had some in a step), draft
    tokens, the drafts the model kept, and the kept ones per draft position."""

    def __init__(self, model_name: str, num_speculative_tokens: int, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.num_drafts = Counter("vllm:spec_decode_num_drafts", "Requests with drafts, counted per step.", labels,
                                  registry=registry).labels(model_name)
        self.num_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.", labels,
                                        registry=registry).labels(model_name)
        self.num_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens the model kept.",
                                           labels, registry=registry).labels(model_name)
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept, per draft position.",
                          labels + ["position"], registry=registry)
        self.accepted_per_pos = [per_pos.labels(model_name, str(position)) for position in range(num_speculative_tokens)]

    def record(self, stats: SpecDecodingStats) -> None:
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, accepted in zip(self.accepted_per_pos, stats.num_accepted_tokens_per_pos):
            counter.inc(accepted)


class ServerMetrics:
    """`cache_info`: the KV-cache configuration as label -> value strings (vllm:cache_config_info)."""

    def __init__(self, model_name: str, max_model_len: int = 2048, cache_info: dict[str, str] | None = None,
                 num_speculative_tokens: int = 0) -> None:
        """`num_speculative_tokens`: with speculative decoding, its drafts' counters (vLLM's
        vllm:spec_decode_*) are kept too."""
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector(model_name)
        self.registry.register(self.engine_stats)
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens received.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=reg).labels(model_name)
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Seconds from arrival to the first output token.",
            labels, buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Seconds between a request's consecutive engine steps "
            "with an output token.", labels, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step (prompts of requests whose first token "
            "came in it, plus tokens generated).", labels, buckets=_ITERATION_TOKENS_BUCKETS,
            registry=reg).labels(model_name)
        self._request_success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                                        labels + ["finished_reason"], registry=reg)
        self.requests_aborted = Counter("vllm_lite:request_aborted", "Requests aborted before they finished "
                                        "(client gone, cancelled).", labels, registry=reg).labels(model_name)
        # vLLM's per-request histograms, observed when a request finishes (as vLLM does).
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from arrival to the last output token.", labels,
            buckets=_REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.request_phase_times = {phase: Histogram(
            f"vllm:request_{phase}_time_seconds", f"Seconds a request spent {doc}.", labels,
            buckets=_REQUEST_LATENCY_BUCKETS, registry=reg).labels(model_name)
            for phase, doc in (("queue", "waiting before it was first scheduled"),
                               ("prefill", "from first scheduled to its first token"),
                               ("decode", "from its first token to its last"),
                               ("inference", "from first scheduled to its last token"))}
        self.time_per_output_token = Histogram(
            "vllm:request_time_per_output_token_seconds", "Decode time / (generated tokens - 1), per request.",
            labels, buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", labels,
            buckets=_token_buckets(max_model_len), registry=reg).labels(model_name)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.", labels,
            buckets=_token_buckets(max_model_len), registry=reg).labels(model_name)
        self.request_num_preemptions = Histogram(
            "vllm:request_num_preemptions", "Times a finished request was preempted.", labels,
            buckets=_token_buckets(max_model_len), registry=reg).labels(model_name)
        self.request_params_n = Histogram(
            "vllm:request_params_n", "The n request parameter.", labels, buckets=(1, 2, 5, 10, 20),
            registry=reg).labels(model_name)
        self.request_params_max_tokens = Histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", labels,
            buckets=_token_buckets(max_model_len), registry=reg).labels(model_name)
        self.spec_decode = SpecDecodeMetrics(model_name, num_speculative_tokens, reg) if num_speculative_tokens else None
        self.model_name = model_name
        self.exposition = self._exposition_registry(cache_info)

    def _exposition_registry(self, cache_info: dict[str, str] | None) -> CollectorRegistry:
        """What /metrics renders: this registry; or, when the server is one of a pool
        (PROMETHEUS_MULTIPROC_DIR set, as prometheus_client's multiprocess mode wants), every
        pool member's counters and histograms summed from their files. The engine's numbers and
        the cache configuration are the engine core's, so one collector of each is right."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            exposition = CollectorRegistry()
            MultiProcessCollector(exposition, path=directory)
            exposition.register(self.engine_stats)
        else:
            exposition = self.registry
        if cache_info:
            exposition.register(CacheConfigCollector(cache_info))
        return exposition

    def record_iteration(self, stats: IterationStats) -> None:
        """One engine step's numbers (AsyncLLM calls this for every EngineCoreOutputs)."""
        self.iteration_tokens.observe(stats.num_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.inter_token_latencies:
            observe_many(self.inter_token_latency, np.concatenate(stats.inter_token_latencies))
        if stats.spec_decoding is not None and self.spec_decode is not None:
            self.spec_decode.record(stats.spec_decoding)
        phases = self.request_phase_times
        for finished in stats.finished_requests:
            phases["queue"].observe(finished.queued_time)
            phases["prefill"].observe(finished.prefill_time)
            phases["decode"].observe(finished.decode_time)
            phases["inference"].observe(finished.inference_time)
            self.time_per_output_token.observe(finished.mean_time_per_output_token)
            self.request_num_preemptions.observe(finished.num_preemptions)

    def record_requests(self, stats: IterationStats) -> None:
        """The per-request metrics from the engine's view of the step's finished requests: LLM's
        stat logger (the server observes them per streamed output instead, in RequestTracker).
        Time to first token is observed when the request finishes."""
        for finished in stats.finished_requests:
            self.prompt_tokens.inc(finished.num_prompt_tokens)
            if finished.num_generation_tokens:
                self.time_to_first_token.observe(finished.first_token_latency)
            self.request_finished(finished.finish_reason)
            self.observe_finished(finished.e2e_latency, finished.num_prompt_tokens, finished.num_generation_tokens)
            if finished.max_tokens is not None:
                self.request_params_max_tokens.observe(finished.max_tokens)
            if finished.n is not None:
                self.request_params_n.observe(finished.n)

    def observe_finished(self, e2e_latency: float, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.e2e_request_latency.observe(e2e_latency)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self, engine_stats: dict[str, Any]) -> bytes:
        self.engine_stats.stats = engine_stats
        return generate_latest(self.exposition)


class RequestTracker:
    """Per-request bookkeeping: call `observe` with every (delta) output of the request."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.num_generated = 0
        self.arrival = time.monotonic()
        self.started = False
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def finish_pooled(self) -> None:
        """An embedding request's end (it generates nothing): its latency, its prompt's size and
        its success, as stopped (vLLM finishes pooling requests so)."""
        self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)
        self.metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        self.metrics.request_finished("stop")

    def observe(self, output: RequestOutput) -> None:
        """Called for every streamed output: what it does per token stays a few attribute reads
        (the generated tokens' counter moves once a step, in `ServerMetrics.record_iteration`)."""
        metrics = self.metrics
        for completion in output.outputs:
            num_new = len(completion.token_ids)
            if num_new:
                if not self.started:
                    metrics.time_to_first_token.observe(time.monotonic() - self.arrival)
                    self.started = True
                self.num_generated += num_new
            if completion.finish_reason is not None:
                metrics.request_finished(completion.finish_reason)
        if output.finished:
            metrics.observe_finished(time.monotonic() - self.arrival, self.num_prompt_tokens, self.num_generated)
            if self.params is not None:  # vLLM's request_params_* histograms
                metrics.request_params_n.observe(self.params.n)
                if self.params.max_tokens is not None:
                    metrics.request_params_max_tokens.observe(self.params.max_tokens)
