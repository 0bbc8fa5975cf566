"""The `vllm-lite` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from vllm_lite.entrypoints.bench import add_bench_parser
from vllm_lite.entrypoints.chat import add_chat_parser
from vllm_lite.entrypoints.run_batch import add_run_batch_parser
from vllm_lite.entrypoints.cli_args import (add_engine_args, add_request_handling_args, engine_args_from,
                                          json_string_list, vllm_argv)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed-sampling", type=int, default=None, dest="sampling_seed")


def cmd_generate(args: argparse.Namespace) -> int:
    from vllm_lite.entrypoints.llm import LLM
    from vllm_lite.sampling_params import SamplingParams

    engine_args = engine_args_from(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed)
    try:
        for output in llm.generate(args.prompts, params, use_tqdm=False):
            print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    finally:
        llm.shutdown()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """Run this node's tensor-parallel ranks of an engine whose core runs on node 0."""
    from vllm_lite.executor.worker_proc import run_worker_node

    return run_worker_node(engine_args_from(args))


def cmd_serve(args: argparse.Namespace) -> int:
    """One API server with its engine core, or (--api-server-count N > 1) N API servers sharing
    the port and one engine core."""
    from vllm_lite.entrypoints.openai.api_server import server_options_from, ssl_options

    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    # A wrong server option (a TLS file, a middleware, a JSON flag) fails now, not after the model
    # loaded (with --api-server-count > 1 each server builds its options once the engine runs).
    server_options_from(args)
    ssl_options(args)
    if args.uds is not None and args.api_server_count > 1:
        raise ValueError("--uds serves one API server; --api-server-count > 1 shares a TCP port")
    if args.api_server_count > 1:
        from vllm_lite.entrypoints.openai.api_server_pool import run_api_server_pool

        return run_api_server_pool(args)
    from vllm_lite.entrypoints.openai.api_server import run_server

    return run_server(args)


def cmd_engine(args: argparse.Namespace) -> int:
    """Serve a standalone engine core until SIGINT/SIGTERM. Clients attach with
    `LLM(engine_address=...)` or `AsyncLLM.connect(...)`."""
    import msgspec

    from vllm_lite.engine.core import run_engine_core
    from vllm_lite.engine.zmq_utils import EngineAddress, check_ipc_free, normalize_address, private_ipc_address

    if args.address:
        check_ipc_free(normalize_address(args.address))  # before the slow part
    vllm_config = engine_args_from(args).create_engine_config()
    address = EngineAddress(normalize_address(args.address)) if args.address else private_ipc_address()
    served = False

    def report(startup: bytes) -> None:
        nonlocal served
        info = msgspec.msgpack.decode(startup)
        if "address" in info:
            served = True
            print(f"vllm-lite engine core serving at {info['address']}", flush=True)
        else:
            print(f"error: engine core failed to start: {info['error_type']}: {info['message']}", file=sys.stderr)

    try:
        return run_engine_core(vllm_config, address.address, report, standalone=True)
    finally:
        if served or address.private_dir is not None:  # never remove another engine's socket
            address.cleanup()


def _add_engine_parser(sub: argparse._SubParsersAction) -> None:
    engine = sub.add_parser("engine", help="serve a standalone engine core that clients attach to")
    add_engine_args(engine)
    engine.add_argument("--address", default=None,
                        help="ipc:///path or tcp://host:port (host defaults to 127.0.0.1, port 0 = any); "
                             "default: a private ipc path, printed at start-up")
    engine.set_defaults(func=cmd_engine)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from vllm_lite.entrypoints.openai.server_state import DEFAULT_MAX_STORED_RESPONSES

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    add_engine_args(serve, model_positional=True)
    add_request_handling_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all interfaces)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--uds", default=None,
                       help="serve on this Unix domain socket path instead of --host/--port (vLLM's flag)")
    serve.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file (vLLM's flag)")
    serve.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file (vLLM's flag)")
    serve.add_argument("--ssl-ca-certs", default=None,
                       help="HTTPS: CA certificates that client certificates are checked against (vLLM's flag)")
    serve.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=None,
                       help="HTTPS: client certificates 0 none, 1 optional, 2 required (Python's ssl.CERT_*; "
                            "vLLM's flag)")
    serve.add_argument("--ssl-ciphers", default=None, help="HTTPS: the allowed ciphers, OpenSSL's format (vLLM's flag)")
    serve.add_argument("--api-key", nargs="+", default=None,
                       help="require `Authorization: Bearer <key>`, one of these keys, on every route but /health "
                            "and /ping (default: $VLLM_LITE_API_KEY, else vLLM's $VLLM_API_KEY)")
    serve.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                       help="/v1/responses: how many stored responses previous_response_id can continue "
                            "(the oldest are forgotten first)")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="streams end with a usage chunk even when stream_options does not ask (vLLM's flag)")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="every response carries X-Request-Id: the request's own, else a new one (vLLM's flag)")
    serve.add_argument("--show-hidden-metrics-for-version", default=None, metavar="VERSION",
                       help="vLLM's flag to show metrics it hid after deprecating them; vllm_lite has "
                            "no hidden metrics, so /metrics is the same with it")
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load reports the generation requests in flight (vLLM's flag)")
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info: the tokenizer's configuration (vLLM's flag; it may "
                            "expose the chat template and special tokens)")
    serve.add_argument("--root-path", default="",
                       help="the path prefix a reverse proxy serves the app under, e.g. /llm (vLLM's flag); "
                            "routes answer with and without it")
    serve.add_argument("--health-check-timeout", type=float, default=5.0,
                       help="seconds /health waits for the engine before answering 503")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="after SIGTERM: seconds in-flight requests may run on before they are ended "
                            "with an error")
    serve.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="API server processes sharing --port and one engine core (vLLM's flag); "
                            "/metrics sums them, /load and stored responses are each server's own")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access log line per HTTP request (vLLM's flag)")
    serve.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                       help="comma-separated paths with no access log line, e.g. /health,/metrics (vLLM's flag)")
    serve.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc and /openapi.json (vLLM's flag)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        serve.add_argument(flag, type=json_string_list, default=["*"],
                           help=f"CORS: allowed {what}, a JSON list (vLLM's flag; default [\"*\"])")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (vLLM's flag)")
    serve.add_argument("--middleware", action="append", default=None, metavar="IMPORT_PATH",
                       help="an ASGI middleware class or an async HTTP middleware function (request, call_next) "
                            "to wrap the app in, e.g. my_pkg.auth.Middleware; repeatable (vLLM's flag)")
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-lite", description="vllm_lite: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="complete prompts once and print the text")
    generate.add_argument("prompts", nargs="+")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)
    worker = sub.add_parser("worker", help="run this node's ranks of a multi-node engine (node_rank >= 1)")
    add_engine_args(worker)
    worker.set_defaults(func=cmd_worker)
    _add_serve_parser(sub)
    _add_engine_parser(sub)
    add_chat_parser(sub)
    add_bench_parser(sub)
    add_run_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(vllm_argv(sys.argv[1:] if argv is None else argv, parser))
    handler: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
