"""`vllm-lite bench throughput` (offline, nano-vllm's workload) and `vllm-lite bench serve`
(a load generator for any OpenAI-compatible endpoint, reporting what `vllm bench serve` does).
Both print a table last."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_lite.entrypoints.cli_args import add_engine_args, engine_args_from
from vllm_lite.sampling_params import SamplingParams

_WORDS = ("the of and to in is was for on are with as by at from this that have it be or an which "
          "river mountain engine token cache block batch request server model signal garden window "
          "music story letter market science history city village quiet ancient bright silver").split()


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: offline throughput, or load against a server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    throughput = kinds.add_parser("throughput", help="offline: N random requests, ignore_eos (nano-vllm's workload)")
    add_engine_args(throughput)
    throughput.add_argument("--num-prompts", type=int, default=256)
    throughput.add_argument("--min-input-len", type=int, default=100)
    throughput.add_argument("--max-input-len", type=int, default=1024)
    throughput.add_argument("--min-output-len", type=int, default=100)
    throughput.add_argument("--max-output-len", type=int, default=1024)
    throughput.add_argument("--temperature", type=float, default=0.6)
    throughput.add_argument("--dataset-seed", type=int, default=0)
    throughput.set_defaults(func=run_throughput)
    serve = kinds.add_parser("serve", help="load generator against an OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    serve.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    serve.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    serve.add_argument("--request-rate", type=float, default=float("inf"),
                       help="requests/s, Poisson arrivals (inf: all at once)")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos (exactly output-len tokens)")
    serve.add_argument("--dataset-seed", type=int, default=0)
    serve.set_defaults(func=run_serve_bench)


def print_table(title: str, rows: Sequence[tuple[str, Any] | str]) -> None:
    """vLLM's layout: `=== title ===`, `label: value` rows, `--- section ---` for plain strings."""
    print(f"{title:=^60}")
    for row in rows:
        if isinstance(row, str):
            print(f"{row:-^60}")
        else:
            label, value = row
            print(f"{label:<44} {value:<15.2f}" if isinstance(value, float) else f"{label:<44} {value:<15}")
    print("=" * 60)


# --------------------------------------------------------------------------- offline


def run_throughput(args: argparse.Namespace) -> int:
    from vllm_lite.entrypoints.llm import LLM

    engine_args = engine_args_from(args)
    prompts, params = _random_workload(args, engine_args.create_engine_config().model_config)
    llm = LLM(**dataclasses.asdict(engine_args))
    try:
        llm.generate(["Benchmark warm-up"], SamplingParams(max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    num_input = sum(len(p["prompt_token_ids"]) for p in prompts)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    print_table(" Offline Throughput Benchmark Result ", [
        ("Requests:", len(outputs)),
        ("Total input tokens:", num_input),
        ("Total output tokens:", num_output),
        ("Elapsed time (s):", elapsed),
        ("Request throughput (req/s):", len(outputs) / elapsed),
        ("Output token throughput (tok/s):", num_output / elapsed),
        ("Total token throughput (tok/s):", (num_input + num_output) / elapsed),
    ])
    return 0


def _random_workload(args: argparse.Namespace, model_config: Any) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    """nano-vllm's: random token ids, random input and output lengths, ignore_eos."""
    if args.max_input_len + args.max_output_len > model_config.max_model_len:
        raise ValueError(f"max_input_len + max_output_len = {args.max_input_len + args.max_output_len} "
                         f"exceeds max_model_len={model_config.max_model_len}")
    rng = random.Random(args.dataset_seed)
    prompts, params = [], []
    for _ in range(args.num_prompts):
        input_len = rng.randint(args.min_input_len, args.max_input_len)
        prompts.append({"prompt_token_ids": [rng.randrange(model_config.hf.vocab_size) for _ in range(input_len)]})
        params.append(SamplingParams(temperature=args.temperature, ignore_eos=True,
                                     max_tokens=rng.randint(args.min_output_len, args.max_output_len)))
    return prompts, params


# --------------------------------------------------------------------------- online


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def run_serve_bench(args: argparse.Namespace) -> int:
    results, duration, model = asyncio.run(_run_load(args))
    print_serve_report(results, duration, args.max_concurrency, model)
    return 0 if any(r.success for r in results) else 1


async def _run_load(args: argparse.Namespace) -> tuple[list[RequestResult], float, str]:
    import httpx

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        model = args.model or (await client.get(f"{base}/v1/models")).raise_for_status().json()["data"][0]["id"]
        payloads = _payloads(args, model)
        semaphore = asyncio.Semaphore(args.max_concurrency or len(payloads))
        rng = random.Random(args.dataset_seed)
        start = time.perf_counter()
        tasks = []
        for payload in payloads:
            tasks.append(asyncio.ensure_future(_limited(semaphore, client, base + args.endpoint, payload)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


def _payloads(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    rng = random.Random(args.dataset_seed)
    payloads = []
    for _ in range(args.num_prompts):
        prompt = " ".join(rng.choice(_WORDS) for _ in range(args.input_len))
        body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": 0.0, "max_tokens": args.output_len}
        if args.ignore_eos:
            body["ignore_eos"] = True
        if args.endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        payloads.append(body)
    return payloads


async def _limited(semaphore: asyncio.Semaphore, client: Any, url: str, payload: dict[str, Any]) -> RequestResult:
    async with semaphore:
        return await send_streaming_request(client, url, payload)


async def send_streaming_request(client: Any, url: str, payload: dict[str, Any]) -> RequestResult:
    """One streaming request; TTFT and inter-token gaps are timed on chunks that carry text."""
    result = RequestResult()
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, num_chunks = now, num_chunks + 1
    except Exception as exc:  # a failed request is counted and reported, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or num_chunks
    result.success = True
    return result


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def print_serve_report(results: list[RequestResult], duration: float, max_concurrency: int | None,
                       model: str) -> None:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    num_input = sum(r.prompt_tokens for r in ok)
    num_output = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itls = [gap * 1000 for r in ok for gap in r.itl]
    if failed:
        print(f"{len(failed)} requests failed; first error: {failed[0].error}")
    rows: list[tuple[str, Any] | str] = [
        ("Model:", model),
        ("Successful requests:", len(ok)),
        ("Failed requests:", len(failed)),
        ("Maximum request concurrency:", str(max_concurrency)),
        ("Benchmark duration (s):", duration),
        ("Total input tokens:", num_input),
        ("Total generated tokens:", num_output),
        ("Request throughput (req/s):", len(ok) / duration),
        ("Output token throughput (tok/s):", num_output / duration),
        ("Total token throughput (tok/s):", (num_input + num_output) / duration),
    ]
    for title, name, values in (("Time to First Token", "TTFT", ttfts),
                                ("Time per Output Token (excl. 1st token)", "TPOT", tpots),
                                ("Inter-token Latency", "ITL", itls)):
        rows.append(title)
        rows += _stat_rows(name, values)
    print_table(" Serving Benchmark Result ", rows)


def _stat_rows(name: str, values_ms: list[float]) -> list[tuple[str, Any]]:
    array = np.asarray(values_ms or [0.0])
    return [(f"Mean {name} (ms):", float(array.mean())),
            (f"Median {name} (ms):", float(np.median(array))),
            (f"P99 {name} (ms):", float(np.percentile(array, 99)))]
