"""`vllm-lite run-batch`: vLLM's batch runner (`vllm run-batch -i IN -o OUT`). Each line of the
input (JSONL in OpenAI's batch format: `custom_id`, `method`, `url`, `body`) is sent as that
request to this server's own app, in process: the same validation, defaults and answers as
`vllm-lite serve`, every line at once (the engine batches them). Each output line is vLLM's:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in the input's
order; a request the app refuses carries its error body in `error`, and a line that is no
request it can send (malformed, another method or URL, `stream: true`) an error message, status
400. Input and output are local paths or http(s) URLs (GET / PUT)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import tempfile
import uuid
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

import httpx
from tqdm import tqdm

logger = logging.getLogger(__name__)

# What the app serves as a JSON POST answered whole (vLLM's runner: chat and embeddings; its
# score, rerank and audio routes are not served here).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_IN_FLIGHT = 1024  # lines sent to the app at once (the engine queues the rest of each)


@dataclasses.dataclass(frozen=True, slots=True)
class BatchLine:
    """One input line, checked: the request to send, or why none can be sent."""

    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    problem: str | None = None


def add_run_batch_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_lite.entrypoints.cli_args import add_engine_args, add_request_handling_args

    batch = sub.add_parser("run-batch", help="run a file of OpenAI batch requests (vLLM's run-batch)")
    batch.add_argument("-i", "--input-file", required=True, help="the JSONL input: a local path or an http(s) URL")
    batch.add_argument("-o", "--output-file", required=True,
                       help="the JSONL output: a local path, or an http(s) URL it is PUT to")
    batch.add_argument("--output-tmp-dir", default=None,
                       help="with an http(s) output: write it here first, then upload the file (vLLM's flag)")
    add_engine_args(batch)
    add_request_handling_args(batch)
    batch.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    import uvloop

    return uvloop.run(run_batch(args))


async def run_batch(args: argparse.Namespace) -> int:
    from vllm_lite.engine.async_llm import AsyncLLM
    from vllm_lite.entrypoints.cli_args import engine_args_from

    text = await read_input(args.input_file)
    lines = [parse_line(line) for line in text.splitlines() if line.strip()]
    engine_args = engine_args_from(args)
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        outputs = await run_lines(engine, lines, args, engine_args.model)
    finally:
        engine.shutdown()
    await write_output(args.output_file, "".join(json.dumps(output) + "\n" for output in outputs),
                       args.output_tmp_dir)
    failed = sum(output["error"] is not None for output in outputs)
    logger.info("run-batch: %d request(s), %d failed", len(outputs), failed)
    return 0


def parse_line(text: str) -> BatchLine:
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(None, problem=f"the line is not JSON: {exc}")
    if not isinstance(line, dict):
        return BatchLine(None, problem=f"the line must be a JSON object, got {type(line).__name__}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str):
        return BatchLine(None, problem=f"custom_id must be a string, got {custom_id!r}")
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    problem = None
    if unknown:
        problem = f"unknown field(s) in the batch line: {', '.join(unknown)}"
    elif line.get("method") != "POST":
        problem = f"method must be POST, got {line.get('method')!r}"
    elif line.get("url") not in BATCH_URLS:
        problem = f"URL {line.get('url')} was used. Supported endpoints: {', '.join(BATCH_URLS)}"
    elif not isinstance(line.get("body"), dict):
        problem = "body must be a JSON object (the request)"
    elif _asks_to_stream(line["body"].get("stream")):
        problem = "Request must not be sent in stream mode"
    return BatchLine(custom_id, line.get("url", ""), line.get("body"), problem)


def _asks_to_stream(value: Any) -> bool:
    """Whether the server would read `stream` as true (pydantic's lax bool: "false" is false); a
    value it cannot read is left to it to refuse by name."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value) if value is not None else False
    except ValidationError:
        return False


async def run_lines(engine: Any, lines: list[BatchLine], args: argparse.Namespace, model: str | None) -> list[dict]:
    """Every line through the server's app (no API key: the runner is its only client)."""
    from vllm_lite.entrypoints.openai.api_server import build_app, server_options_from, show_info_logs

    show_info_logs()  # (--enable-log-requests logs at INFO, as in the server)
    options = dataclasses.replace(server_options_from(args), api_key=None, dev_mode=False)
    names = args.served_model_name or ([model] if model else [])
    app = build_app(engine, names, options=options)
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        with tqdm(total=len(lines), desc="Running batch", unit="req") as bar:
            async def run(line: BatchLine) -> dict:
                async with limit:
                    output = await run_line(client, line)
                bar.update(1)
                return output

            return list(await asyncio.gather(*(run(line) for line in lines)))


async def run_line(client: httpx.AsyncClient, line: BatchLine) -> dict:
    request_id = f"vllm-batch-{uuid.uuid4().hex}"
    if line.problem is not None:
        return batch_output(line.custom_id, 400, request_id, None, line.problem)
    try:
        # ASCII JSON: a lone surrogate travels escaped, as from any client, and the app answers it.
        reply = await client.post(line.url, content=json.dumps(line.body).encode(),
                                  headers={"content-type": "application/json"})
        body = reply.json()
    except Exception as exc:  # this line's failure alone (the others are still answered)
        logger.exception("run-batch: the request of custom_id %r failed", line.custom_id)
        return batch_output(line.custom_id, 500, request_id, None, f"{type(exc).__name__}: {exc}")
    if reply.status_code == 200:
        return batch_output(line.custom_id, 200, request_id, body, None)
    return batch_output(line.custom_id, reply.status_code, request_id, None, body)


def batch_output(custom_id: str | None, status_code: int, request_id: str, body: dict | None,
                 error: Any) -> dict:
    return {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": error}


def _is_url(path_or_url: str) -> bool:
    return path_or_url.startswith(("http://", "https://"))


async def read_input(path_or_url: str) -> str:
    if not _is_url(path_or_url):
        return Path(path_or_url).read_text(encoding="utf-8")
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            reply = await client.get(path_or_url)
            reply.raise_for_status()
            return reply.text
    except httpx.HTTPError as exc:
        raise ValueError(f"--input-file {path_or_url}: {exc}") from None


async def write_output(path_or_url: str, text: str, tmp_dir: str | None) -> None:
    if not _is_url(path_or_url):
        Path(path_or_url).write_text(text, encoding="utf-8")
        return
    try:
        async with httpx.AsyncClient(timeout=1000) as client:
            if tmp_dir is None:
                reply = await client.put(path_or_url, content=text.encode())
            else:
                with tempfile.NamedTemporaryFile("w+b", dir=tmp_dir, prefix="tmp_batch_output_", suffix=".jsonl") as file:
                    file.write(text.encode())
                    file.flush()
                    file.seek(0)
                    reply = await client.put(path_or_url, content=_chunks(file))
            reply.raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"--output-file {path_or_url}: {exc}") from None


async def _chunks(file: Any, size: int = 1 << 20) -> AsyncIterator[bytes]:
    while chunk := file.read(size):
        yield chunk
