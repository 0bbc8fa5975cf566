"""The server records a step's inter-token latencies with one increment per histogram bucket
(`observe_many`): the exposition must be what one `observe` per value gives."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from vllm_lite.entrypoints.openai.metrics import observe_many

BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.5, 1.0]


def _histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("itl_seconds", "test", ["model_name"], buckets=BUCKETS, registry=registry).labels("m")


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for metric in registry.collect() for s in metric.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("values", [
    [0.003, 0.01, 0.0100001, 0.3, 0.3, 7.5, 0.05, 1.0],  # on and just past bucket bounds, past the last
    list(np.random.default_rng(0).exponential(0.05, size=500)),
    [0.02],
])
def test_observe_many_equals_observe_each(values: list[float]) -> None:
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    each = _histogram(one_by_one)
    for value in values:
        each.observe(value)
    observe_many(_histogram(batched), np.asarray(values))
    expected, got = _samples(one_by_one), _samples(batched)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    assert b"itl_seconds_count" in generate_latest(batched)
