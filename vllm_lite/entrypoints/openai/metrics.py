"""Prometheus metrics of one server (or of one `LLM` with disable_log_stats=False, read by its
`get_metrics()`), in a registry of its own (never the global one). A metric
vLLM also has carries vLLM's name (`vllm:` prefix), so dashboards built for vLLM find it; the
ones vLLM does not have are `vllm_lite:` (`vllm_lite:prefix_cache_hit_rate`,
`vllm_lite:request_aborted`): no `vllm:` name that vLLM lacks. vLLM's labels too: `model_name`,
and `engine` (the data-parallel rank whose step or request it counts) on every per-engine one, so
vLLM's Grafana dashboards (which select by engine) read them. Beside them, as on vLLM's /metrics:
prometheus-fastapi-instrumentator's HTTP metrics (api_server.instrument_http) and the process's
own (process_*, python_gc_*, python_info).

Three sources, each counted where vLLM counts it:
- the engine's own counters (`get_stats()`, each data-parallel engine's: running/waiting
  requests, KV blocks, prefix-cache queries and hits, preemptions, sleep state; and the client's
  processor-cache queries and hits), read at scrape time by `EngineStatsCollector`;
- each engine step's IterationStats (engine/stats.py: engine-core timestamps), passed to
  `record_iteration` by AsyncLLM: tokens per step, the generated tokens' counter (once a step, as
  vLLM counts it, not once per streamed output), inter-token latency, and for finished requests
  the queue / prefill / decode / inference times and time per output token;
- what the server sees of each request's outputs (prompt tokens by source, time to first token,
  e2e latency, tokens per finished request, finished and aborted requests), recorded by
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
from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest)
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


SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class EngineStatsCollector:
    """Turns the engine's last `get_stats()` snapshot into gauges and counters, one series per
    engine (`engine`: its data-parallel rank, as vLLM labels them). The /metrics handler refreshes
    the snapshot (an awaitable call) just before it renders the registry."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        per_engine = self.stats.get("per_engine") or [self.stats]
        families: dict[str, Metric] = {}
        for engine, stats in enumerate(per_engine):
            for family, labels, value in self._engine_samples(stats):
                families.setdefault(family.name, family).add_metric([self.model_name, str(engine), *labels], value)
        yield from families.values()
        # the client's own (this API server's processor cache): not one engine's
        yield self._client_counter("vllm:mm_cache_queries", "Images looked up in this client's processor cache.",
                                   self.stats.get("mm_cache_queries", 0))
        yield self._client_counter("vllm:mm_cache_hits", "Images found in this client's processor cache.",
                                   self.stats.get("mm_cache_hits", 0))
        if "max_lora" in self.stats:  # an engine serving LoRA adapters: vLLM's info gauge, set to the time
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric([str(self.stats["max_lora"]), self.stats["waiting_lora_adapters"],
                             self.stats["running_lora_adapters"]], time.time())
            yield info

    def _client_counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        """A count of this client's (the API server's), under engine 0 (data parallel: the client's
        whole, not one engine's)."""
        metric = _counter(name, doc)
        metric.add_metric([self.model_name, "0"], value)
        return metric

    def _engine_samples(self, stats: dict[str, Any]) -> Iterator[tuple[Metric, list[str], float]]:
        """(family, labels past model_name and engine, value) of one engine's stats."""
        queries = stats.get("prefix_cache_queries", 0)
        hits = stats.get("prefix_cache_hits", 0)
        deferred = stats.get("num_waiting_deferred", 0)
        yield _gauge("vllm:num_requests_running", "Requests in the running batch."), [], stats.get("num_running", 0)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled."), [], stats.get("num_waiting", 0)
        by_reason = _gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by reason: 'capacity' = "
                           "waiting for room in the batch; 'deferred' = held by a transient constraint (a grammar "
                           "still compiling). Sum of all reasons equals vllm:num_requests_waiting.", "reason")
        yield by_reason, ["capacity"], stats.get("num_waiting", 0) - deferred
        yield by_reason, ["deferred"], deferred
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full)."), [], \
            kv_cache_usage(stats)
        yield _gauge("vllm_lite:prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens."), [], \
            hits / queries if queries else 0.0
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."), [], queries
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."), [], hits
        # vLLM's KV-connector cache (another instance's or a tier's KV): no connector here, none found there
        yield _counter("vllm:external_prefix_cache_queries", "Prompt tokens looked up in a KV connector's cache "
                       "(vllm_lite has no KV connector)."), [], 0
        yield _counter("vllm:external_prefix_cache_hits", "Prompt tokens found in a KV connector's cache "
                       "(vllm_lite has no KV connector)."), [], 0
        yield _counter("vllm:num_preemptions", "Requests preempted (KV blocks ran out)."), [], \
            stats.get("num_preemptions", 0)
        sleep = _gauge("vllm:engine_sleep_state", "Engine sleep state: awake = 1 when not asleep (nor paused); "
                       "weights_offloaded = 1 at sleep level 1 (here: the KV cache released, the weights kept); "
                       "discard_all = 1 at sleep level 2.", "sleep_state")
        for state, value in zip(SLEEP_STATES, _sleep_state(stats.get("sleep_level"))):
            yield sleep, [state], value


def _sleep_state(level: int | None) -> tuple[int, int, int]:
    """vLLM's (awake, weights_offloaded, discard_all) of a sleep level (None: awake)."""
    return (1 if level is None else 0, int(level == 1), int(level == 2))


_ENGINE_LABELS = ("model_name", "engine")


def _gauge(name: str, doc: str, *extra_labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=[*_ENGINE_LABELS, *extra_labels])


def _counter(name: str, doc: str, *extra_labels: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=[*_ENGINE_LABELS, *extra_labels])


class CacheConfigCollector:
    """vllm:cache_config_info: the KV-cache configuration as labels, value 1 (a collector, not a
    Gauge, so that a pool's multiprocess files do not give one series per process)."""

    def __init__(self, cache_info: dict[str, str], num_engines: int = 1) -> None:
        self.cache_info = dict(sorted(cache_info.items()))
        self.num_engines = num_engines

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("vllm:cache_config_info", "The KV-cache configuration (labels; value 1).",
                                 labels=[*self.cache_info, "engine"])
        for engine in range(self.num_engines):
            info.add_metric([*self.cache_info.values(), str(engine)], 1)
        yield info


def num_engines(vllm_config: Any) -> int:
    """The data-parallel engines (the metrics' `engine` label values 0..n-1), for ServerMetrics."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return 1 if parallel is None else parallel.data_parallel_size


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
            "kv_cache_max_concurrency": f"{num_blocks / blocks_per_request:.2f}",
            # (vLLM's KV-cache dashboard shows these: the prefix cache's block keys are sha256
            # chains, core/kv_cache_manager.py; no blocks kept on the host, none offloaded)
            "prefix_caching_hash_algo": "sha256", "num_cpu_blocks": "None", "kv_offloading_size": "None"}


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
    """vLLM's speculative decoding counters, one engine's: drafts (requests that had some in a
    step), draft tokens, the drafts the model kept, and the kept ones per draft position."""

    def __init__(self, families: dict[str, Counter], labels: list[str], num_speculative_tokens: int) -> None:
        self.num_drafts = families["num_drafts"].labels(*labels)
        self.num_draft_tokens = families["num_draft_tokens"].labels(*labels)
        self.num_accepted_tokens = families["num_accepted_tokens"].labels(*labels)
        self.accepted_per_pos = [families["per_pos"].labels(*labels, str(position))
                                 for position in range(num_speculative_tokens)]

    @staticmethod
    def families(registry: CollectorRegistry) -> dict[str, Counter]:
        return {"num_drafts": Counter("vllm:spec_decode_num_drafts", "Requests with drafts, counted per step.",
                                      _ENGINE_LABELS, registry=registry),
                "num_draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.", _ENGINE_LABELS,
                                            registry=registry),
                "num_accepted_tokens": Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens the model kept.",
                                               _ENGINE_LABELS, registry=registry),
                "per_pos": Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens kept, per draft "
                                   "position.", (*_ENGINE_LABELS, "position"), registry=registry)}

    def record(self, stats: SpecDecodingStats) -> None:
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for counter, accepted in zip(self.accepted_per_pos, stats.num_accepted_tokens_per_pos):
            counter.inc(accepted)


FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


class EngineSeries:
    """One engine's children of the server's labelled metrics (vLLM labels each with the engine
    that served the request or step), made once, so recording is a method call on a child."""

    # (children of prometheus_client's Counter / Histogram, set from `ServerMetrics.families`)
    prompt_tokens: Any
    prompt_tokens_cached: Any
    generation_tokens: Any
    time_to_first_token: Any
    inter_token_latency: Any
    iteration_tokens: Any
    e2e_request_latency: Any
    time_per_output_token: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any
    request_max_num_generation_tokens: Any
    request_prefill_kv_computed_tokens: Any
    request_num_preemptions: Any
    request_params_n: Any
    request_params_max_tokens: Any

    def __init__(self, metrics: ServerMetrics, engine: int, num_speculative_tokens: int) -> None:
        labels = [metrics.model_name, str(engine)]
        family = metrics.families
        for name in EngineSeries.__annotations__:
            setattr(self, name, family[name].labels(*labels))
        self.request_phase_times = {phase: family[f"request_{phase}_time"].labels(*labels)
                                    for phase in ("queue", "prefill", "decode", "inference")}
        self.request_success = {reason: family["request_success"].labels(*labels, reason) for reason in FINISH_REASONS}
        self.prompt_tokens_by_source = {source: family["prompt_tokens_by_source"].labels(*labels, source)
                                        for source in PROMPT_TOKEN_SOURCES}
        self.prompt_tokens_cached_by_source = {source: family["prompt_tokens_cached_by_source"].labels(*labels, source)
                                               for source in CACHE_HIT_SOURCES}
        self.spec_decode = (SpecDecodeMetrics(metrics.spec_decode_families, labels, num_speculative_tokens)
                            if num_speculative_tokens else None)
        self._success_family, self._labels = family["request_success"], labels

    def request_finished(self, finish_reason: str) -> None:
        counter = self.request_success.get(finish_reason)
        if counter is None:  # (a reason beyond vLLM's list)
            counter = self.request_success[finish_reason] = self._success_family.labels(*self._labels, finish_reason)
        counter.inc()

    def prompt_started(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A request's prompt, counted at its first output (vLLM counts it at its prefill): by
        where its tokens came from (computed, or the prefix cache)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_by_source["local_compute"].inc(num_prompt_tokens - num_cached_tokens)
        self.prompt_tokens_by_source["local_cache_hit"].inc(num_cached_tokens)
        self.prompt_tokens_cached.inc(num_cached_tokens)
        self.prompt_tokens_cached_by_source["device"].inc(num_cached_tokens)

    def observe_finished(self, e2e_latency: float, num_prompt_tokens: int, num_cached_tokens: int,
                         num_generation_tokens: int) -> None:
        self.e2e_request_latency.observe(e2e_latency)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_prefill_kv_computed_tokens.observe(num_prompt_tokens - num_cached_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def observe_request(self, n: int, max_num_generation_tokens: int) -> None:
        """Once per request (all of its n sequences finished), as vLLM observes them."""
        self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max_num_generation_tokens)


class ServerMetrics:
    """`cache_info`: the KV-cache configuration as label -> value strings (vllm:cache_config_info).
    Every vLLM-named metric carries vLLM's labels: `model_name` and `engine` (the data-parallel
    rank that served the request or step: 0..num_engines-1)."""

    def __init__(self, model_name: str, max_model_len: int = 2048, cache_info: dict[str, str] | None = None,
                 num_speculative_tokens: int = 0, num_engines: int = 1) -> None:
        """`num_speculative_tokens`: with speculative decoding, its drafts' counters (vLLM's
        vllm:spec_decode_*) are kept too."""
        self.registry = CollectorRegistry()
        self.engine_stats = EngineStatsCollector(model_name)
        self.registry.register(self.engine_stats)
        self.model_name = model_name
        self.families = self._families(self.registry, max_model_len)
        self.spec_decode_families = SpecDecodeMetrics.families(self.registry) if num_speculative_tokens else {}
        self.engines = [EngineSeries(self, engine, num_speculative_tokens) for engine in range(num_engines)]
        self.requests_aborted = Counter("vllm_lite:request_aborted", "Requests aborted before they finished "
                                        "(client gone, cancelled).", ["model_name"],
                                        registry=self.registry).labels(model_name)
        rejections = Counter("vllm:admission_rejections", "Requests refused at admission (503), by the limit "
                             "they would pass.", ["model_name", "reason"], registry=self.registry)
        self.admission_rejections = {reason: rejections.labels(model_name, reason) for reason in ADMISSION_REASONS}
        self.exposition = self._exposition_registry(cache_info, num_engines)

    @staticmethod
    def _families(reg: CollectorRegistry, max_model_len: int) -> dict[str, Any]:
        labels = _ENGINE_LABELS
        tokens = _token_buckets(max_model_len)
        families: dict[str, Any] = {
            "prompt_tokens": Counter("vllm:prompt_tokens", "Prompt tokens (prefilled or from the prefix cache).",
                                     labels, registry=reg),
            "prompt_tokens_by_source": Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source: computed "
                                               "(local_compute) or from the prefix cache (local_cache_hit).",
                                               (*labels, "source"), registry=reg),
            "prompt_tokens_cached": Counter("vllm:prompt_tokens_cached", "Prompt tokens from the prefix cache.",
                                            labels, registry=reg),
            "prompt_tokens_cached_by_source": Counter(
                "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that supplied "
                "them (here always the engine's own KV cache: device).", (*labels, "source"), registry=reg),
            "generation_tokens": Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=reg),
            "time_to_first_token": Histogram(
                "vllm:time_to_first_token_seconds", "Seconds from arrival to the first output token.",
                labels, buckets=_TTFT_BUCKETS, registry=reg),
            "inter_token_latency": Histogram(
                "vllm:inter_token_latency_seconds", "Seconds between a request's consecutive engine steps "
                "with an output token.", labels, buckets=_ITL_BUCKETS, registry=reg),
            "iteration_tokens": Histogram(
                "vllm:iteration_tokens_total", "Tokens per engine step (the prompt tokens computed for requests "
                "whose first token came in it, plus tokens generated).", labels,
                buckets=_ITERATION_TOKENS_BUCKETS, registry=reg),
            "request_success": Counter("vllm:request_success", "Finished sequences by finish reason.",
                                       (*labels, "finished_reason"), registry=reg),
            # vLLM's per-request histograms, observed when a request finishes (as vLLM does).
            "e2e_request_latency": Histogram(
                "vllm:e2e_request_latency_seconds", "Seconds from arrival to the last output token.", labels,
                buckets=_REQUEST_LATENCY_BUCKETS, registry=reg),
            "time_per_output_token": Histogram(
                "vllm:request_time_per_output_token_seconds", "Decode time / (generated tokens - 1), per request.",
                labels, buckets=_ITL_BUCKETS, registry=reg),
            "request_prompt_tokens": Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               labels, buckets=tokens, registry=reg),
            "request_generation_tokens": Histogram(
                "vllm:request_generation_tokens", "Generated tokens per finished request.", labels, buckets=tokens,
                registry=reg),
            "request_max_num_generation_tokens": Histogram(
                "vllm:request_max_num_generation_tokens", "The most tokens one of a request's n sequences generated.",
                labels, buckets=tokens, registry=reg),
            "request_prefill_kv_computed_tokens": Histogram(
                "vllm:request_prefill_kv_computed_tokens", "Prompt tokens a finished request computed (its prefix-"
                "cache hits excluded).", labels, buckets=tokens, registry=reg),
            "request_num_preemptions": Histogram("vllm:request_num_preemptions", "Times a finished request was "
                                                 "preempted.", labels, buckets=tokens, registry=reg),
            "request_params_n": Histogram("vllm:request_params_n", "The n request parameter.", labels,
                                          buckets=(1, 2, 5, 10, 20), registry=reg),
            "request_params_max_tokens": Histogram("vllm:request_params_max_tokens", "The max_tokens request "
                                                   "parameter.", labels, buckets=tokens, registry=reg),
        }
        for phase, doc in (("queue", "waiting before it was first scheduled"),
                           ("prefill", "from first scheduled to its first token"),
                           ("decode", "from its first token to its last"),
                           ("inference", "from first scheduled to its last token")):
            families[f"request_{phase}_time"] = Histogram(
                f"vllm:request_{phase}_time_seconds", f"Seconds a request spent {doc}.", labels,
                buckets=_REQUEST_LATENCY_BUCKETS, registry=reg)
        return families

    def _exposition_registry(self, cache_info: dict[str, str] | None, num_engines: int) -> CollectorRegistry:
        """What /metrics renders: this registry (with the process's own: process_*, python_gc_*,
        python_info, as prometheus_client's default registry has them); or, when the server is one
        of a pool (PROMETHEUS_MULTIPROC_DIR set, as prometheus_client's multiprocess mode wants),
        every pool member's counters and histograms summed from their files. The engine's numbers
        and the cache configuration are the engine core's, so one collector of each is right."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            exposition = CollectorRegistry()
            MultiProcessCollector(exposition, path=directory)
            exposition.register(self.engine_stats)
        else:
            exposition = self.registry
            for collector in (ProcessCollector, PlatformCollector, GCCollector):
                collector(registry=exposition)
        if cache_info:
            exposition.register(CacheConfigCollector(cache_info, num_engines))
        return exposition

    def record_iteration(self, stats: IterationStats) -> None:
        """One engine step's numbers (AsyncLLM calls this for every EngineCoreOutputs)."""
        series = self.engines[stats.engine_index]
        series.iteration_tokens.observe(stats.num_tokens)
        if stats.num_generation_tokens:
            series.generation_tokens.inc(stats.num_generation_tokens)
        if stats.inter_token_latencies:
            observe_many(series.inter_token_latency, np.concatenate(stats.inter_token_latencies))
        if stats.spec_decoding is not None and series.spec_decode is not None:
            series.spec_decode.record(stats.spec_decoding)
        phases = series.request_phase_times
        for finished in stats.finished_requests:
            phases["queue"].observe(finished.queued_time)
            phases["prefill"].observe(finished.prefill_time)
            phases["decode"].observe(finished.decode_time)
            phases["inference"].observe(finished.inference_time)
            series.time_per_output_token.observe(finished.mean_time_per_output_token)
            series.request_num_preemptions.observe(finished.num_preemptions)

    def record_requests(self, stats: IterationStats) -> None:
        """The per-request metrics from the engine's view of the step's finished requests: LLM's
        stat logger (the server observes them per streamed output instead, in RequestTracker).
        Time to first token is observed when the request finishes."""
        series = self.engines[stats.engine_index]
        for finished in stats.finished_requests:
            series.prompt_started(finished.num_prompt_tokens, finished.num_cached_tokens)
            if finished.num_generation_tokens:
                series.time_to_first_token.observe(finished.first_token_latency)
            series.request_finished(finished.finish_reason)
            series.observe_finished(finished.e2e_latency, finished.num_prompt_tokens, finished.num_cached_tokens,
                                    finished.num_generation_tokens)
            if finished.max_tokens is not None:
                series.request_params_max_tokens.observe(finished.max_tokens)
            if finished.n is not None:
                series.observe_request(finished.n, finished.max_num_generation_tokens)

    def admission_rejected(self, reason: str) -> None:
        self.admission_rejections[reason].inc()

    def render(self, engine_stats: dict[str, Any]) -> bytes:
        self.engine_stats.stats = engine_stats
        return generate_latest(self.exposition)


class RequestTracker:
    """Per-request bookkeeping: call `observe` with every (delta) output of the request. Its
    series are those of the engine that served it (RequestStateStats.engine_index)."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.num_cached_tokens = 0
        self.num_generated = 0
        # per sequence, for n > 1 (vllm:request_max_num_generation_tokens)
        self.generated_by_index = [0] * params.n if params is not None and params.n > 1 else None
        self.arrival = time.monotonic()
        self.started = False
        self.series: EngineSeries | None = None  # the serving engine's, once an output said which

    def _series(self, output: Any) -> EngineSeries:
        stats = output.metrics
        self.series = self.metrics.engines[stats.engine_index if stats is not None else 0]
        return self.series

    def failed(self) -> None:
        """A step failed on the request after it was admitted: vLLM's finish reason "error" (under
        the engine of its outputs so far; engine 0 before its first)."""
        (self.series or self.metrics.engines[0]).request_finished("error")

    def finish_pooled(self, output: Any) -> None:
        """An embedding request's end (it generates nothing): its prompt, latency and success, as
        stopped (vLLM finishes pooling requests so)."""
        series = self._series(output)
        series.prompt_started(self.num_prompt_tokens, output.num_cached_tokens)
        series.observe_finished(time.monotonic() - self.arrival, self.num_prompt_tokens, output.num_cached_tokens, 0)
        series.request_finished("stop")

    def observe(self, output: RequestOutput) -> None:
        """Called for every streamed output: what it does per token stays a few attribute reads
        (the generated tokens' counter moves once a step, in `ServerMetrics.record_iteration`)."""
        series = None
        for completion in output.outputs:
            num_new = len(completion.token_ids)
            if num_new:
                if not self.started:
                    series = series or self._series(output)
                    series.time_to_first_token.observe(time.monotonic() - self.arrival)
                    self.num_cached_tokens = output.num_cached_tokens
                    series.prompt_started(self.num_prompt_tokens, self.num_cached_tokens)
                    self.started = True
                self.num_generated += num_new
                if self.generated_by_index is not None:
                    self.generated_by_index[completion.index] += num_new
            if completion.finish_reason is not None:
                series = series or self._series(output)
                series.request_finished(completion.finish_reason)
                if self.params is not None and self.params.max_tokens is not None:  # per sequence, as vLLM
                    series.request_params_max_tokens.observe(self.params.max_tokens)
        if output.finished:
            series = series or self._series(output)
            series.observe_finished(time.monotonic() - self.arrival, self.num_prompt_tokens, self.num_cached_tokens,
                                    self.num_generated)
            if self.params is not None:
                most = max(self.generated_by_index) if self.generated_by_index is not None else self.num_generated
                series.observe_request(self.params.n, most)
