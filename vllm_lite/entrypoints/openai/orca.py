"""ORCA load reports (vLLM's): a completion or chat request sent with the header
`endpoint-load-metrics-format: text` or `json` gets its (non-streamed) response with an
`endpoint-load-metrics` header carrying the engine's load, for load balancers that weigh
backends by it (Envoy's BackendUtilization, GKE):

    endpoint-load-metrics: TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=0.0
    endpoint-load-metrics: JSON {"named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 0.0}}

The values are the gauges `/metrics` reports (`vllm:kv_cache_usage_perc`,
`vllm:num_requests_waiting`), read when the response is ready. Another format is refused (400)."""

from __future__ import annotations

import json
from typing import Any

from vllm_lite.entrypoints.openai.errors import ApiError
from vllm_lite.engine.stats import kv_cache_usage

ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"
ORCA_FORMATS = ("text", "json")


def requested_format(headers: Any) -> str | None:
    """The format a request asks for (None: no report), checked before the request runs."""
    value = headers.get(ORCA_FORMAT_HEADER)
    if not value:
        return None
    if value.lower() not in ORCA_FORMATS:
        raise ApiError(400, "BadRequestError", f"the {ORCA_FORMAT_HEADER} header must be one of "
                       f"{', '.join(ORCA_FORMATS)}, got {value!r}", ORCA_FORMAT_HEADER)
    return value.lower()


def named_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """The ORCA metrics vLLM reports, from the engine's get_stats()."""
    return {"kv_cache_usage_perc": float(kv_cache_usage(stats)),
            "num_requests_waiting": float(stats.get("num_waiting", 0))}


def orca_header(metrics_format: str, metrics: dict[str, float]) -> dict[str, str]:
    if metrics_format == "text":
        text = ", ".join(f"named_metrics.{name}={value}" for name, value in metrics.items())
        return {ORCA_HEADER: f"TEXT {text}"}
    return {ORCA_HEADER: f"JSON {json.dumps({'named_metrics': metrics})}"}
