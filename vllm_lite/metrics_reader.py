"""What `LLM.get_metrics()` returns: vLLM's snapshot types (vllm.v1.metrics.reader), read from
a Prometheus registry of the engine's own (never prometheus_client's global one), so code written
against vLLM's reader runs unchanged:

    for metric in llm.get_metrics():
        if isinstance(metric, Histogram):
            print(metric.name, metric.count, metric.sum, metric.buckets)

Only `vllm:` metrics are read, as vLLM does (vllm_lite's own `vllm_lite:` ones are on /metrics).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client import Metric as PrometheusMetric
from prometheus_client.samples import Sample


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """vLLM's per-position counters (speculative decoding's accepted tokens per draft position,
    `values[p]` for position p), read from a counter with a `position` label."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """`buckets`: upper bound (as Prometheus writes it: "0.5", "+Inf") -> cumulative count."""

    count: int
    sum: float
    buckets: dict[str, int]


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.name.startswith("vllm:"):
            metrics.extend(_read(family))
    return metrics


def _read(family: PrometheusMetric) -> Iterable[Metric]:
    if family.type == "gauge":
        return [Gauge(family.name, s.labels, s.value) for s in _samples(family, "")]
    if family.type == "counter":
        samples = _samples(family, "_total")
        if samples and "position" in samples[0].labels:
            return _vectors(family.name, samples)
        return [Counter(family.name, s.labels, int(s.value)) for s in samples]
    if family.type == "histogram":
        return _histograms(family)
    raise ValueError(f"metric {family.name} has type {family.type!r}, which the snapshot does not read")


def _samples(family: PrometheusMetric, suffix: str) -> list[Sample]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _vectors(name: str, samples: list[Sample]) -> list[Vector]:
    """One Vector per label set but `position`: the counts in position order."""
    by_labels: dict[tuple[tuple[str, str], ...], dict[int, int]] = {}
    for sample in samples:
        labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "position"))
        by_labels.setdefault(labels, {})[int(sample.labels["position"])] = int(sample.value)
    return [Vector(name, dict(labels), [counts[p] for p in sorted(counts)]) for labels, counts in by_labels.items()]


def _histograms(family: PrometheusMetric) -> list[Histogram]:
    """One Histogram per label set: its buckets (the `le` label) with its count and sum."""
    by_labels: dict[tuple[tuple[str, str], ...], Histogram] = {}
    for sample in _samples(family, "_bucket"):
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        key = tuple(sorted(labels.items()))
        histogram = by_labels.setdefault(key, Histogram(family.name, labels, 0, 0.0, {}))
        histogram.buckets[sample.labels["le"]] = int(sample.value)
    for suffix in ("_count", "_sum"):
        for sample in _samples(family, suffix):
            histogram = by_labels[tuple(sorted(sample.labels.items()))]
            if suffix == "_count":
                histogram.count = int(sample.value)
            else:
                histogram.sum = sample.value
    return list(by_labels.values())
