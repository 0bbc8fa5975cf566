"""Tool calls in a model's text, by the formats vLLM's `--tool-call-parser` names, and the JSON
schemas that make `tool_choice: "required"` / a named function hold by construction.

| parser | the model writes |
|---|---|
| hermes (Qwen2.5/3, Hermes) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number |
| llama3_json | `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by `;` |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` |
| granite (Granite 3.x) | `<|tool_call|>[...]` (3.0) or `<tool_call>[...]` (3.1), the array as mistral's |
| phi4_mini_json (Phi-4-mini) | `functools[{"name": ..., "arguments" or "parameters": {...}}, ...]` (no content) |
| jamba | `<tool_calls>[...]</tool_calls>`, the array as mistral's |
| pythonic (Llama 4, Qwen3-coder style) | `[get_weather(city="Paris"), ...]` |
| lfm2 (Liquid LFM2) | `<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>`, text around it is content |
| qwen3_coder (Qwen3-Coder; also `qwen3_xml`) | `<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`, any number; text outside them is content; each value typed by the tool's JSON schema |
| openai (gpt-oss) | harmony messages to `functions.NAME` on the commentary channel, the body the arguments (harmony.py) |
| gemma4 (Gemma 4) | `<\|tool_call>call:get_weather{city:<\|"\|>Paris<\|"\|>,days:2}<tool_call\|>`, any number; text outside them is content; strings between `<\|"\|>`, bare values read as JSON (numbers, booleans, null), nested `{...}` / `[...]` |

`qwen3_json` is hermes, `llama4_json` llama3_json (vLLM's aliases).

A parser takes the text and the request's tools' parameter schemas (function name -> its
`parameters`; read by the formats whose arguments are untyped text, qwen3_coder) and returns the
calls and the text outside them (the message `content`, None when empty).
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_lite.entrypoints.openai.harmony import CALL, CALL_BLOCK_START, CHANNEL, CONSTRAIN, MESSAGE
from vllm_lite.reasoning_tags import HARMONY_MARKERS

@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict[str, Any]:
        return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    tool_calls: list[ParsedToolCall]
    content: str | None


def _call(name: Any, arguments: Any) -> ParsedToolCall | None:
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _content(text: str) -> str | None:
    return text if text.strip() else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedOutput:
    calls = []
    for match in _HERMES.finditer(text):
        value = _json_object(match.group(1))
        call = _call(value.get("name"), value.get("arguments", {})) if isinstance(value, dict) else None
        if call is None:
            return ParsedOutput([], text)  # not well formed: it stays text, as vLLM does
        calls.append(call)
    if not calls:
        return ParsedOutput([], text)
    return ParsedOutput(calls, _content(text[: text.index("<tool_call>")]))


def parse_llama3_json(text: str) -> ParsedOutput:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedOutput([], text)
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            return ParsedOutput([], text)
        call = _call(value.get("name"), value.get("parameters", value.get("arguments", {}))) \
            if isinstance(value, dict) else None
        if call is None:
            return ParsedOutput([], text)
        calls.append(call)
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return ParsedOutput(calls, None)


@dataclass(frozen=True, slots=True)
class ArrayFormat:
    """A format whose calls are a JSON array of `{"name", <arguments key>}` objects after a
    marker: the text before the first marker is the content (`content_before`)."""

    markers: tuple[str, ...]
    argument_keys: tuple[str, ...] = ("arguments",)
    content_before: bool = True

    def find(self, text: str) -> tuple[int, int] | None:
        """(where the first marker starts, where the array starts) or None."""
        found = [(text.find(marker), marker) for marker in self.markers if marker in text]
        if not found:
            return None
        start, marker = min(found)
        return start, start + len(marker)

    def parse(self, text: str) -> ParsedOutput:
        where = self.find(text)
        if where is None:
            return ParsedOutput([], text)
        body = text[where[1]:].lstrip()
        try:
            value, _ = json.JSONDecoder().raw_decode(body)  # (an end tag or text may follow the array)
        except ValueError:
            return ParsedOutput([], text)
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list):
            return ParsedOutput([], text)
        calls = [_call(v.get("name"), next((v[k] for k in self.argument_keys if k in v), {}))
                 if isinstance(v, dict) else None for v in value]
        if not calls or None in calls:
            return ParsedOutput([], text)
        return ParsedOutput(calls, _content(text[:where[0]]) if self.content_before else None)  # type: ignore[arg-type]


ARRAY_FORMATS: dict[str, ArrayFormat] = {
    "mistral": ArrayFormat(("[TOOL_CALLS]",)),
    "granite": ArrayFormat(("<|tool_call|>", "<tool_call>")),  # Granite 3.0's special token, 3.1's text
    "phi4_mini_json": ArrayFormat(("functools",), ("arguments", "parameters"), content_before=False),
    "jamba": ArrayFormat(("<tool_calls>",)),
}


LFM2_START, LFM2_END = "<|tool_call_start|>", "<|tool_call_end|>"


def parse_lfm2(text: str) -> ParsedOutput:
    """Liquid's LFM2: a pythonic list between `<|tool_call_start|>` and `<|tool_call_end|>`; the
    text around it is the content."""
    before, start, rest = text.partition(LFM2_START)
    if not start:
        return ParsedOutput([], text)
    inside, _, after = rest.partition(LFM2_END)
    parsed = parse_pythonic(inside)
    if not parsed.tool_calls:
        return ParsedOutput([], text)
    return ParsedOutput(parsed.tool_calls, _content(before + after))


def parse_pythonic(text: str) -> ParsedOutput:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return ParsedOutput([], text)
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return ParsedOutput([], text)
    if not isinstance(tree, ast.List):
        return ParsedOutput([], text)
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return ParsedOutput([], text)
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return ParsedOutput([], text)
        calls.append(ParsedToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return ParsedOutput(calls, None)


GEMMA4_CALL_START, GEMMA4_CALL_END, GEMMA4_STRING = "<|tool_call>", "<tool_call|>", '<|"|>'


def parse_gemma4(text: str) -> ParsedOutput:
    """Gemma 4: `<|tool_call>call:NAME{ARGS}<tool_call|>` blocks; the text around them is the
    content. A block that does not read whole leaves the reply plain text."""
    calls, outside, rest = [], [], text
    while True:
        before, start, after = rest.partition(GEMMA4_CALL_START)
        outside.append(before)
        if not start:
            break
        body, end, rest = after.partition(GEMMA4_CALL_END)
        call = _gemma4_call(body) if end else None
        if call is None:
            return ParsedOutput([], text)
        calls.append(call)
    return ParsedOutput(calls, _content("".join(outside))) if calls else ParsedOutput([], text)


def _gemma4_call(body: str) -> ParsedToolCall | None:
    body = body.strip()
    brace = body.find("{")
    if not body.startswith("call:") or brace < 0:
        return None
    try:
        arguments, end = _gemma4_object(body, brace + 1)
    except ValueError:
        return None
    name = body[len("call:"):brace].strip()
    if not name or body[end:].strip():
        return None
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _gemma4_skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " ,\n\t":
        i += 1
    return i


def _gemma4_object(text: str, i: int) -> tuple[dict[str, Any], int]:
    """The object whose `{` is just before `i`: (its value, the index past its `}`)."""
    result: dict[str, Any] = {}
    while (i := _gemma4_skip(text, i)) < len(text):
        if text[i] == "}":
            return result, i + 1
        colon = text.find(":", i)
        if colon < 0:
            raise ValueError("a key without a value")
        key = text[i:colon].strip().removeprefix(GEMMA4_STRING).removesuffix(GEMMA4_STRING)
        result[key], i = _gemma4_value(text, colon + 1)
    raise ValueError("an unclosed object")


def _gemma4_array(text: str, i: int) -> tuple[list[Any], int]:
    items: list[Any] = []
    while (i := _gemma4_skip(text, i)) < len(text):
        if text[i] == "]":
            return items, i + 1
        item, i = _gemma4_value(text, i)
        items.append(item)
    raise ValueError("an unclosed array")


def _gemma4_value(text: str, i: int) -> tuple[Any, int]:
    while i < len(text) and text[i] in " \n\t":
        i += 1
    if text.startswith(GEMMA4_STRING, i):
        end = text.find(GEMMA4_STRING, i + len(GEMMA4_STRING))
        if end < 0:
            raise ValueError("an unterminated string")
        return text[i + len(GEMMA4_STRING):end], end + len(GEMMA4_STRING)
    if text.startswith("{", i):
        return _gemma4_object(text, i + 1)
    if text.startswith("[", i):
        return _gemma4_array(text, i + 1)
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    raw = text[i:end].strip()
    if not raw:
        raise ValueError("a missing value")
    try:
        return json.loads(raw), end
    except json.JSONDecodeError:
        return raw, end  # (a bare word: as written)


QWEN3_XML_OPEN, QWEN3_XML_CLOSE, QWEN3_FUNCTION = "<tool_call>", "</tool_call>", "<function="
_QWEN3_PARAMETER = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=)|$)",
                              re.DOTALL)
_QWEN3_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.DOTALL)


def parse_qwen3_xml(text: str, schemas: Mapping[str, Any]) -> ParsedOutput:
    """Qwen3-Coder's XML calls (vLLM's qwen3_coder): `<tool_call>` blocks (or a bare
    `<function=...>` the model wrote without one), each one function with `<parameter=...>`
    values; a value loses one wrapping newline each side, then takes its type from the tool's
    schema (vLLM's coercion: a parameter the schema does not type stays a string). Text outside
    the blocks is the content; a block without a function leaves the reply as text."""
    opener = QWEN3_XML_OPEN if QWEN3_XML_OPEN in text else QWEN3_FUNCTION if QWEN3_FUNCTION in text else None
    if opener is None:
        return ParsedOutput([], text)
    first = text.index(opener)
    calls, outside = [], [text[:first]]
    blocks = text[first:].split(QWEN3_XML_OPEN)[1:] if opener == QWEN3_XML_OPEN else [text[first:]]
    for block in blocks:
        body, _, after = block.partition(QWEN3_XML_CLOSE)
        functions = list(_QWEN3_FUNCTION.finditer(body))
        if not functions:
            return ParsedOutput([], text)
        for function in functions:
            name = function.group(1).strip()
            properties = (schemas.get(name) or {}).get("properties") or {}
            arguments = {match.group(1).strip(): _typed(_unwrapped(match.group(2)), properties.get(match.group(1).strip()))
                         for match in _QWEN3_PARAMETER.finditer(function.group(2))}
            calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        outside.append(after)
    return ParsedOutput(calls, _content("".join(outside)))


def _unwrapped(value: str) -> str:
    """The value without one leading and one trailing newline (the template's markup)."""
    return value.removeprefix("\n").removesuffix("\n")


# vLLM's order of trying a schema's types, and its other names for them
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_TYPE_NAMES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
               "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
               "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
               "float": "number", "float32": "number", "float64": "number", "double": "number",
               "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array"}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type (vLLM's coerce_to_schema_type: the first of the
    schema's types the text reads as, by _TYPE_ORDER); no schema: the text itself."""
    if not isinstance(schema, dict):
        return value
    types = {_TYPE_NAMES.get(t.strip().lower(), t.strip().lower()) for t in _schema_types(schema)}
    for kind in _TYPE_ORDER:
        if kind not in types:
            continue
        if kind == "string":
            return value
        typed = _read_as(value, kind)
        if typed is not _UNREAD:
            return typed
    whole = _finite_json(value)
    return value if whole is _UNREAD else whole


_UNREAD = object()


def _read_as(value: str, kind: str) -> Any:
    if kind == "null":
        return None if value.lower() == "null" else _UNREAD
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return _UNREAD
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return _UNREAD
        return _UNREAD if not math.isfinite(number) else int(number) if number == int(number) else number
    if kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(value.lower().strip(), _UNREAD)
    return _finite_json(value)  # object, array


def _finite_json(value: str) -> Any:
    try:
        parsed = json.loads(value)
    except ValueError:
        return _UNREAD
    try:
        json.dumps(parsed, allow_nan=False)
    except ValueError:  # (1e999 reads as inf: no JSON value)
        return _UNREAD
    return parsed


def _schema_types(schema: dict[str, Any]) -> set[str]:
    """The types a JSON schema allows (`type`, an `enum`'s values, anyOf / oneOf / allOf); none
    said: string."""
    types: set[str] = set()
    declared = schema.get("type")
    types.update([declared] if isinstance(declared, str) else [t for t in declared or () if isinstance(t, str)]
                 if isinstance(declared, list) else [])
    enum_types = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
                  list: "array", dict: "object"}
    for value in schema.get("enum") or () if isinstance(schema.get("enum"), list) else ():
        types.add(enum_types.get(type(value), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or () if isinstance(schema.get(key), list) else ():
            if isinstance(choice, dict):
                types |= _schema_types(choice)
    return types or {"string"}


ToolSchemas = Mapping[str, Any]  # function name -> its parameters' JSON schema


_OPENAI_CALL = re.compile(re.escape(CALL_BLOCK_START) + r"([^<]+)" + re.escape(CHANNEL) + r"commentary"
                          + re.escape(CONSTRAIN) + r"([^<]*)" + re.escape(MESSAGE) + r"(.*?)("
                          + re.escape(CALL) + r"|$)", re.DOTALL)


def openai_call_blocks(text: str) -> list[tuple[str, str, str, bool]]:
    """(name, content type, body, whether its end was read) of each call block harmony.split wrote."""
    return [(name, content_type, body, bool(end)) for name, content_type, body, end in _OPENAI_CALL.findall(text)]


def parse_openai(text: str) -> ParsedOutput:
    """gpt-oss's calls (vLLM's `openai` parser), as harmony.split writes them after the content:
    a JSON body is the arguments (compacted as vLLM does; left as written when it does not
    parse), another content type's body is passed as it is."""
    start = text.find(CALL_BLOCK_START)
    if start < 0:
        return ParsedOutput([], _content(text))
    calls = []
    for name, content_type, body, _ in openai_call_blocks(text[start:]):
        arguments = body
        if "json" in content_type:
            value = _json_object(body)
            arguments = body if value is None else json.dumps(value, ensure_ascii=False)
        calls.append(ParsedToolCall(name, arguments))
    return ParsedOutput(calls, _content(text[:start]))


def _text_only(parse: Callable[[str], ParsedOutput]) -> Callable[[str, ToolSchemas], ParsedOutput]:
    return lambda text, schemas: parse(text)


TOOL_PARSERS: dict[str, Callable[[str, ToolSchemas], ParsedOutput]] = {
    "hermes": _text_only(parse_hermes),
    "qwen3": _text_only(parse_hermes),  # Qwen3 writes the hermes format
    "qwen3_json": _text_only(parse_hermes),  # (vLLM's name for it)
    "llama3_json": _text_only(parse_llama3_json),
    "llama4_json": _text_only(parse_llama3_json),
    "pythonic": _text_only(parse_pythonic),
    "lfm2": _text_only(parse_lfm2),
    "qwen3_coder": parse_qwen3_xml,
    "qwen3_xml": parse_qwen3_xml,  # (vLLM's other name for it)
    "openai": _text_only(parse_openai),  # gpt-oss (harmony.py)
    "gemma4": _text_only(parse_gemma4),
    **{name: _text_only(array_format.parse) for name, array_format in ARRAY_FORMATS.items()},
}


_HERMES_TAGS = ("<tool_call>", "</tool_call>")
# The text each parser looks for: where a tokenizer has one as a special token, the reply must be
# detokenized with special tokens kept, or the parser never sees it (vLLM's adjust_request).
TOOL_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": _HERMES_TAGS, "qwen3": _HERMES_TAGS, "qwen3_json": _HERMES_TAGS,
    "llama3_json": ("<|python_tag|>",), "llama4_json": ("<|python_tag|>",),
    "pythonic": ("<|python_start|>", "<|python_end|>"),
    "lfm2": (LFM2_START, LFM2_END),
    "qwen3_coder": (QWEN3_XML_OPEN, QWEN3_XML_CLOSE), "qwen3_xml": (QWEN3_XML_OPEN, QWEN3_XML_CLOSE),
    "mistral": ("[TOOL_CALLS]",), "granite": ("<|tool_call|>", "<tool_call>"), "phi4_mini_json": ("functools",),
    "jamba": ("<tool_calls>", "</tool_calls>"),
    "gemma4": (GEMMA4_CALL_START, GEMMA4_CALL_END, GEMMA4_STRING),
    "openai": HARMONY_MARKERS,
}


# ---- tool_choice "required" / named: the output is the calls' JSON, enforced by a schema ----

def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("tools entries must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    return function


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object", "properties": {}}


def required_calls_schema(tools: list[dict[str, Any]], single: bool = False) -> dict[str, Any]:
    """A JSON array of one or more `{"name": <a tool>, "parameters": <its arguments>}`
    (vLLM's form for tool_choice "required"; `single`: exactly one, for parallel_tool_calls
    false). Each tool's `$defs` move to the array's root,
    where its `#/$defs/...` references resolve (as vLLM does); two tools defining one name
    differently are a ValueError. The request's tools are not changed."""
    variants, defs = [], {}
    for tool in tools:
        function = function_of(tool)
        parameters = dict(parameters_schema(function))
        for name, schema in (parameters.pop("$defs", None) or {}).items():
            if defs.get(name, schema) != schema:
                raise ValueError(f"tools define $defs/{name} differently, so a required call cannot use both")
            defs[name] = schema
        variants.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required_calls(text: str) -> list[ParsedToolCall]:
    value = json.loads(text, strict=False)
    return [ParsedToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value]
