"""EngineArgs on the command line: shared by every `vllm-lite` subcommand (cli.py, bench.py,
chat.py, the OpenAI server), so none of them imports another for it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

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
            parser.add_argument(flag, type=_flag_type(f.type), default=default)
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None,
                            help="model folder, .gguf file or hub id org/name (default: the demo model)")


def _flag_type(annotation: str) -> Callable[[str], Any]:
    """A flag's parser from its field's annotation (a string here): str, a JSON object for dicts
    (vLLM's --override-generation-config '{"temperature": 0.5}'), float, else int."""
    base = annotation.split(" | ")[0]
    if base == "str":
        return str
    if base == "float":
        return float
    if base.startswith("dict"):
        return json_object
    return int


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None


def json_object(text: str) -> dict[str, Any]:
    value = _json(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def json_string_list(text: str) -> list[str]:
    """vLLM's form of list flags (the CORS ones): a JSON list of strings, e.g. '["https://a.example"]'."""
    value = _json(text)
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    values = {name: getattr(namespace, name) for name in EngineArgs.field_names()}
    if getattr(namespace, "model_tag", None):
        values["model"] = namespace.model_tag
    return EngineArgs(**values)
