"""`vllm-lite bench throughput` and `vllm-lite chat` with a local engine (the server-facing
commands are tested against a live server in test_openai_server.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_lite.entrypoints.bench import RequestResult, print_serve_report
from vllm_lite.entrypoints.cli import build_parser
from vllm_lite.entrypoints.cli import main as cli_main


def test_bench_throughput_prints_table(tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["bench", "throughput", "--model", str(tiny_qwen3), "--max-model-len", "128",
                   "--num-prompts", "8", "--min-input-len", "8", "--max-input-len", "24",
                   "--min-output-len", "4", "--max-output-len", "12"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Offline Throughput Benchmark Result" in out and re.search(r"Requests:\s+8\b", out)
    output_tokens = int(re.search(r"Total output tokens:\s+(\d+)", out).group(1))
    assert 8 * 4 <= output_tokens <= 8 * 12  # ignore_eos: every request runs to its own length
    for label in ("Request throughput (req/s):", "Output token throughput (tok/s):"):
        assert label in out


def test_bench_throughput_rejects_lengths_over_max_model_len(tiny_qwen3: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["bench", "throughput", "--model", str(tiny_qwen3), "--max-model-len", "64",
                   "--num-prompts", "2", "--max-input-len", "60", "--max-output-len", "10"])
    assert rc == 2 and "exceeds max_model_len=64" in capsys.readouterr().err


def test_chat_quick_with_local_engine(tiny_qwen3: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["chat", "--model", str(tiny_qwen3), "--max-model-len", "128", "--quick", "hello",
                   "--max-tokens", "5", "--temperature", "0"])
    assert rc == 0 and capsys.readouterr().out.strip()


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve", "some/model", "--max-model-len", "256"])
    assert (args.host, args.model_tag, args.max_model_len, args.api_key) == ("127.0.0.1", "some/model", 256, None)


def test_serve_report_percentiles(capsys: pytest.CaptureFixture[str]) -> None:
    results = [RequestResult(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1 * (i + 1), latency=1.0,
                             itl=[0.02] * 4) for i in range(3)]
    results.append(RequestResult(error="HTTP 400: bad"))
    print_serve_report(results, duration=2.0, max_concurrency=None, model="m")
    out = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+3\b", out) and re.search(r"Failed requests:\s+1\b", out)
    assert re.search(r"Median TTFT \(ms\):\s+200\.00", out) and re.search(r"Mean ITL \(ms\):\s+20\.00", out)
    assert re.search(r"Output token throughput \(tok/s\):\s+7\.50", out) and "first error: HTTP 400: bad" in out
