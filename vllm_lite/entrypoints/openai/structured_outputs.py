"""The request fields that ask for structured outputs, as vLLM's server reads them, turned
into one `StructuredOutputsParams`:

| field | meaning |
|---|---|
| response_format `{"type": "json_object"}` | any JSON object |
| response_format `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` | that schema |
| response_format `{"type": "structural_tag", ...}` | xgrammar structural tag (the object as JSON) |
| structured_outputs `{json / regex / choice / grammar / json_object / structural_tag}` | vLLM's current form |
| guided_json / guided_regex / guided_choice / guided_grammar | vLLM's legacy form |

At most one of them may ask. The schema/regex/grammar itself is checked where the request
enters the engine; the server checks it first too, so that the 400 names the field that asked
(`param`: response_format, structured_outputs or guided_*), as vLLM and OpenAI do.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_lite.engine.request_checks import check_structured_outputs
from vllm_lite.sampling_params import SamplingParams, StructuredOutputsParams

LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# vLLM's structured-output backend names that mean the one here (xgrammar): the server's
# --structured-outputs-config backend and a request's `guided_decoding_backend` (or none).
BACKENDS = ("auto", "xgrammar")
ACCEPTED_BACKENDS = (None, *BACKENDS)


class StructuredFieldError(ValueError):
    """An invalid structured-output field; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs_from_fields(response_format: dict[str, Any] | None,
                                   structured_outputs: dict[str, Any] | None,
                                   legacy: dict[str, Any], backend: str | None,
                                   disable_any_whitespace: bool = False) -> StructuredOutputsParams | None:
    """`legacy`: the guided_* fields that were set (name -> value)."""
    if backend not in ACCEPTED_BACKENDS:
        raise StructuredFieldError("guided_decoding_backend",
                                   f"guided_decoding_backend must be one of auto, xgrammar; got {backend!r}")
    sources = {}
    from_format = _from_response_format(response_format)
    if from_format is not None:
        sources["response_format"] = from_format
    if structured_outputs is not None:
        sources["structured_outputs"] = _build("structured_outputs", structured_outputs)
    for name, value in legacy.items():
        sources[name] = _build(name, {LEGACY_FIELDS[name]: value,
                                      "disable_any_whitespace": disable_any_whitespace})
    if len(sources) > 1:
        raise StructuredFieldError(next(iter(sources)), "only one of response_format, structured_outputs and "
                                   f"guided_* may constrain the output; got {sorted(sources)}")
    return next(iter(sources.values()), None)


def _from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredFieldError("response_format", "response_format json_schema needs a 'json_schema' "
                                       "object with the schema under 'schema'")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise StructuredFieldError("response_format", "response_format.json_schema.schema must be a JSON "
                                       f"schema object, got {type(schema).__name__}")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredFieldError("response_format", f"response_format.json_schema.strict must be a bool, "
                                       f"got {strict!r}")
        # The output follows the schema whether or not `strict` is set: constrained decoding
        # is always strict.
        return _build("response_format", {"json": schema})
    if kind == "structural_tag":
        tag = {key: value for key, value in response_format.items()}
        return _build("response_format", {"structural_tag": json.dumps(tag)})
    raise StructuredFieldError("response_format", "response_format.type must be one of text, json_object, "
                               f"json_schema, structural_tag; got {kind!r}")


def _build(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """The constraint `param` asks for, its schema/regex/grammar checked."""
    try:
        params = StructuredOutputsParams(**fields)
        check_structured_outputs(SamplingParams(structured_outputs=params))
        return params
    except TypeError as exc:  # an unknown field
        raise StructuredFieldError(param, f"{param}: {exc}") from None
    except ValueError as exc:
        raise StructuredFieldError(param, f"{param}: {exc}") from None
