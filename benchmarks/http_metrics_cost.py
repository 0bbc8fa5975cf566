"""What vLLM's HTTP metrics layer (prometheus-fastapi-instrumentator, api_server.instrument_http)
costs per request: the server's app on a fake engine (no model: the HTTP side alone), driven
in-process by httpx, with and without the layer, rounds interleaved; the fastest round of each.

    .venv/bin/python benchmarks/http_metrics_cost.py --requests 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "entrypoints")]

import httpx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import vllm_lite.entrypoints.openai.api_server as api_server  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402
from hf_reference import build_tokenizer  # noqa: E402

BODY = {"prompt": "a b", "max_tokens": 1}


async def us_per_request(tokenizer: object, requests: int) -> float:
    app = api_server.build_app(FakeEngine(tokenizer, max_model_len=64), ["m"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        for _ in range(50):  # (warm-up)
            await client.post("/v1/completions", json=BODY)
        start = time.perf_counter()
        for _ in range(requests):
            await client.post("/v1/completions", json=BODY)
        return (time.perf_counter() - start) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        build_tokenizer(Path(directory))
        tokenizer = AutoTokenizer.from_pretrained(directory)
    instrument = api_server.instrument_http
    timings: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(args.rounds):
        for label, layer in (("with", instrument), ("without", lambda app, registry: None)):
            api_server.instrument_http = layer
            timings[label].append(asyncio.run(us_per_request(tokenizer, args.requests)))
    api_server.instrument_http = instrument
    best = {label: min(values) for label, values in timings.items()}
    print(f"{'us per request':>16} {'with the layer':>15} {'without':>8} {'difference':>11}")
    print(f"{'fastest round':>16} {best['with']:15.0f} {best['without']:8.0f} {best['with'] - best['without']:11.0f}")


if __name__ == "__main__":
    main()
