"""EngineArgs on the command line: shared by every `vllm-lite` subcommand (cli.py, bench.py,
chat.py, the OpenAI server), so none of them imports another for it. Also vLLM's command-line
forms (its FlexibleArgumentParser's), which `vllm_argv` rewrites to the plain flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from vllm_lite.config import EngineArgs
from vllm_lite.entrypoints.openai.tool_parsers import TOOL_PARSERS

# vLLM's short spellings of the engine flags this engine has. Its others (-O3, ...) name flags
# this engine does not have: argparse refuses them by name.
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp", "pipeline_parallel_size": "-pp",
               "enable_expert_parallel": "-ep", "quantization": "-q", "nnodes": "-n", "node_rank": "-r"}
# The fields whose flag takes vLLM's human-readable integers ("32k", "1K", "25.6k", "2G").
HUMAN_READABLE_FIELDS = frozenset({"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"})
DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One `--flag` per EngineArgs field (vLLM's spelling: --max-model-len ...)."""
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        flags = ["--" + f.name.replace("_", "-")] + ([SHORT_FLAGS[f.name]] if f.name in SHORT_FLAGS else [])
        default = getattr(defaults, f.name)
        if isinstance(default, bool) or f.type == "bool | None":  # annotations are strings here
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default)
        elif f.type.startswith("list["):
            parser.add_argument(*flags, nargs="+", default=default)
        else:
            parser.add_argument(*flags, type=_flag_type(f.name, f.type), default=default)
    # (read before parsing, by `vllm_argv`: listed here for --help)
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="flags from a YAML file, one key per long flag name (vLLM's); the command line wins")
    if model_positional:
        parser.add_argument("model_tag", nargs="?", default=None,
                            help="model folder, .gguf file or hub id org/name (default: the demo model)")


def add_request_handling_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags for how a request is read, rendered and answered (what `serve` and
    `run-batch` share; serve's own add the HTTP side: address, TLS, auth, CORS, logs)."""
    from vllm_lite.entrypoints.chat_content import CONTENT_FORMATS
    from vllm_lite.entrypoints.openai.server_state import DEFAULT_MAX_N_SEQUENCES, DEFAULT_MAX_REQUEST_BODY_BYTES

    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 before they are read")
    parser.add_argument("--max-n-sequences", type=int, default=DEFAULT_MAX_N_SEQUENCES,
                        help="the largest `n` a request may ask for (vLLM: VLLM_MAX_N_SEQUENCES)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", choices=tuple(TOOL_PARSERS),
                        default=None, help="how tool calls are read from the model's text")
    # (--reasoning-parser is an engine flag, EngineArgs.reasoning_parser, as in vLLM: the server
    # also returns the <think> part of chat replies as `reasoning` with it)
    parser.add_argument("--structured-outputs-config", dest="structured_outputs_config", type=json_object,
                        default=None, help="vLLM's flag, a JSON object or key by key (--structured-outputs-config."
                                           "backend xgrammar): backend (auto or xgrammar, the only one here) and "
                                           "disable_any_whitespace (compact JSON); its other fields are refused by name")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept `chat_template` in requests (refused by default, as in vLLM)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage carries prompt_tokens_details.cached_tokens, the prompt tokens served "
                             "from the prefix cache (vLLM's flag)")
    parser.add_argument("--chat-template-timeout", type=float, default=5.0,
                        help="seconds a chat template may render before the request gets 400")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: the model argument)")
    parser.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None,
                        help="LoRA adapters served under their own model names (needs --enable-lora): name=path, or "
                             "a JSON object with name, path and base_model_name (vLLM's flag)")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template for chat requests instead of the tokenizer's: a file's path or the "
                             "template itself (vLLM's flag)")
    parser.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                        help="chat template arguments every chat request gets unless it sets them, a JSON object, "
                             "e.g. '{\"enable_thinking\": false}' (vLLM's flag)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprob tokens as 'token_id:<int>' unless a request says otherwise (vLLM's flag)")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='with tool_choice "none" the chat template gets no tools (vLLM\'s flag)')
    parser.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                        help="message content as the chat template reads it: 'string' (text parts joined), "
                             "'openai' (a list of parts), or 'auto' (read from the template) (vLLM's flag)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each generation request: id, sampling params, prompt (vLLM's flag)")
    parser.add_argument("--enable-log-outputs", action="store_true",
                        help="with --enable-log-requests, also log each finished completion's text (vLLM's flag)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="with --enable-log-requests: the most prompt characters and token ids logged")
    parser.add_argument("--response-role", default="assistant",
                        help="the chat reply's role when add_generation_prompt is true (vLLM's flag)")


def _lora_module(text: str) -> Any:
    from vllm_lite.entrypoints.openai.serving_models import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _flag_type(name: str, annotation: str) -> Callable[[str], Any]:
    """A flag's parser from its field's annotation (a string here): str, a JSON object for dicts
    (vLLM's --override-generation-config '{"temperature": 0.5}'), float, else int; vLLM's
    human-readable integers for the sizes it takes them for (max_model_len also "auto")."""
    if name == "max_model_len":
        return human_readable_int_or_auto
    if name in HUMAN_READABLE_FIELDS:
        return human_readable_int
    base = annotation.split(" | ")[0]
    if base == "str":
        return str
    if base == "float":
        return float
    if base.startswith("dict"):
        return json_object
    return int


def human_readable_int(text: str) -> int:
    """vLLM's human-readable integers: "1k" 1,000, "1K" 1,024, "25.6k" 25,600 (a decimal number
    with a decimal suffix), else a plain integer. A value that is no whole number is refused."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer (vLLM's forms: 1000, 1k, 1K, 25.6k): {text!r}")
    number, suffix = match.groups()
    if suffix in BINARY_SUFFIXES and "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with the binary suffix {suffix} (vLLM's rule; "
                                         f"{number}{suffix.lower()} is decimal): {text!r}")
    try:
        value = Decimal(number) * (DECIMAL_SUFFIXES.get(suffix) or BINARY_SUFFIXES.get(suffix) or 1)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r} is {value}")
    return int(value)


def human_readable_int_or_auto(text: str) -> int:
    """`human_readable_int`, or vLLM's "auto" / -1 (-1: EngineArgs fits it to the KV cache)."""
    return -1 if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


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


def vllm_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's command-line forms (its FlexibleArgumentParser's), rewritten to `parser`'s plain
    flags; what cannot be rewritten ends the program with an error naming it (`parser.error`):
    - `--config FILE.yaml`: options from a YAML file, one key per long flag name (true / false
      for switches, a list for several values, a mapping for a JSON flag), placed before the
      command line's own options, which win (vLLM's order: command line > file > defaults);
    - underscores in a flag's name: `--max_model_len` is `--max-model-len`;
    - a JSON-object flag given key by key: `--hf-overrides.rope_theta 1e6` (a key ending in `+`
      appends to a list: `--X.items+ a,b`), merged in order with the flag's JSON form."""
    argv = _with_config_file(list(argv), parser)
    argv = [_dashed(arg) for arg in argv]
    return _dotted_keys_merged(argv, parser)


def _with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        parser.error("--config: given more than once")
    index = at[0]
    if argv[index] == "--config":
        if index + 1 >= len(argv):
            parser.error("--config: expected a YAML file")
        path, rest = argv[index + 1], argv[index + 2:]
    else:
        path, rest = argv[index].removeprefix("--config="), argv[index + 1:]
    command = argv[0] if argv and not argv[0].startswith("-") else None
    options = _options_of(parser, command)
    file_args = [arg for key, value in _read_config_file(path, parser).items()
                 for arg in _config_entry_args(str(key), value, path, options, parser)]
    head, before = argv[:1 if command else 0], argv[1 if command else 0:index]
    if command == "serve":  # its model, named on the command line before or just after --config, stays first
        if before and not before[0].startswith("-"):
            head, before = head + before[:1], before[1:]
        elif not before and rest and not rest[0].startswith("-"):
            head, rest = head + rest[:1], rest[1:]
    return head + file_args + before + rest


def _read_config_file(path: str, parser: argparse.ArgumentParser) -> dict[Any, Any]:
    import yaml

    if Path(path).suffix not in (".yaml", ".yml"):
        parser.error(f"--config: the file must be YAML (.yaml or .yml), got {path!r}")
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if config is None:
        return {}
    if not isinstance(config, dict):
        parser.error(f"--config {path}: must be a mapping of flag names to values, got {type(config).__name__}")
    return config


def _config_entry_args(key: str, value: Any, path: str, options: dict[str, argparse.Action],
                       parser: argparse.ArgumentParser) -> list[str]:
    """One YAML entry as command-line arguments (vLLM's rule). A flag the command does not have
    is passed on as it is, for argparse to refuse by name."""
    flag = "--" + key.replace("_", "-")
    if value is None:
        parser.error(f"--config {path}: {key!r} has no value")
    if isinstance(value, bool):
        if value:
            return [flag]
        negated = "--no-" + flag[2:]
        if negated in options:
            return [negated]
        return [] if flag in options else [flag]  # (off: the switch's default)
    if isinstance(value, list):
        return [flag, *map(str, value)] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def _options_of(parser: argparse.ArgumentParser, command: str | None) -> dict[str, argparse.Action]:
    """The option strings of `command`'s parser (the top parser's without one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]._option_string_actions
    return parser._option_string_actions


def _dashed(arg: str) -> str:
    """`--flag_name[.key_name][=value]` with dashes in the flag's name (vLLM's rule: the keys
    after a dot and the value keep their underscores)."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    flag, dot, keys = name.partition(".")
    return flag.replace("_", "-") + dot + keys + equals + value


_DOTTED = re.compile(r"(--[A-Za-z][\w-]*)\.(.+)")


def _dotted_keys_merged(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--flag.a.b value` arguments merged, in order, into one `--flag JSON` per flag (its JSON
    form, `--flag '{...}'`, is merged too: a later one replaces what came before it)."""
    dotted = {match.group(1) for arg in argv if (match := _DOTTED.fullmatch(arg.partition("=")[0]))}
    if not dotted:
        return argv
    merged: dict[str, dict[str, Any]] = {}
    kept: list[str] = []
    i = 0
    while i < len(argv):
        name, equals, value = argv[i].partition("=")
        match = _DOTTED.fullmatch(name)
        if match is None and name not in dotted:
            kept.append(argv[i])
            i += 1
            continue
        if not equals:
            if i + 1 >= len(argv):
                parser.error(f"{name}: expected a value")
            value = argv[i + 1]
        i += 1 if equals else 2
        if match is None:  # the flag's JSON form
            try:
                merged[name] = json_object(value)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{name}: {exc}")
        else:
            _merge_key(merged.setdefault(match.group(1), {}), match.group(2).split("."), value)
    return kept + [arg for flag, config in merged.items() for arg in (flag, json.dumps(config))]


def _merge_key(config: dict[str, Any], keys: list[str], text: str) -> None:
    """Set `config[k1][k2]...` to `text` read as JSON, else a human-readable integer, else the
    text itself; a last key ending in `+` appends `text`'s comma-separated items to a list."""
    *parents, last = keys
    for key in parents:
        child = config.get(key)
        config[key] = child = child if isinstance(child, dict) else {}
        config = child
    if last.endswith("+"):
        last = last[:-1]
        items = config.get(last)
        config[last] = (items if isinstance(items, list) else []) + text.split(",")
        return
    config[last] = _loose_value(text)


def _loose_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return human_readable_int(text)
    except argparse.ArgumentTypeError:
        return text
