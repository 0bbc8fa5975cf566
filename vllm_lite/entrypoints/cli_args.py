"""EngineArgs on the command line: shared by every `vllm-lite` subcommand (cli.py, bench.py,
chat.py, the OpenAI server), so none of them imports another for it."""

from __future__ import annotations

import argparse
import dataclasses

from vllm_lite.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One `--flag` per EngineArgs field (vLLM's spelling: --max-model-len ...)."""
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool) or f.type == "bool | None":  # annotations are strings here
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = str if f.type.split(" | ")[0] == "str" else int
            parser.add_argument(flag, type=kind, default=default)
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None,
                            help="model folder, .gguf file or hub id org/name (default: the demo model)")


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(namespace, name) for name in EngineArgs.field_names()}
    if getattr(namespace, "model_tag", None):
        values["model"] = namespace.model_tag
    return EngineArgs(**values)
