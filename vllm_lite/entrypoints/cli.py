"""The `vllm-lite` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from vllm_lite.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One `--flag` per EngineArgs field (vLLM's spelling: --max-model-len ...)."""
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = str if f.name in ("model", "tokenizer", "dtype", "device") else int
            parser.add_argument(flag, type=kind, default=default)
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None, help="model folder (default: the demo model)")


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(namespace, name) for name in EngineArgs.field_names()}
    if getattr(namespace, "model_tag", None):
        values["model"] = namespace.model_tag
    return EngineArgs(**values)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed-sampling", type=int, default=None, dest="sampling_seed")


def cmd_generate(args: argparse.Namespace) -> int:
    from vllm_lite import LLM, SamplingParams

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-lite", description="vllm_lite: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    generate = sub.add_parser("generate", help="complete prompts once and print the text")
    generate.add_argument("prompts", nargs="+")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], Any] = args.func
    try:
        return int(handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
