"""OpenAI's error object and the mapping of exceptions onto it (status, type, message, param)."""

from __future__ import annotations

import re
from typing import Any

from vllm_lite.exceptions import AdmissionRejectedError, EngineDeadError
from vllm_lite.entrypoints.openai.protocol import RequestParamError

_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+) ")


def error_body(status_code: int, err_type: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status_code}}


# Anthropic's error types by status (its SDKs pick the exception class from the status).
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          503: "overloaded_error"}
ANTHROPIC_ROUTE_PREFIX = "/v1/messages"


def anthropic_error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error object: what its clients read from /v1/messages."""
    kind = _ANTHROPIC_ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def route_error_body(path: str, status_code: int, err_type: str, message: str,
                     param: str | None = None) -> dict[str, Any]:
    """The error object in the shape of the API the route belongs to: Anthropic's on its
    Messages routes, OpenAI's elsewhere."""
    if path == ANTHROPIC_ROUTE_PREFIX or path.startswith(ANTHROPIC_ROUTE_PREFIX + "/"):
        return anthropic_error_body(status_code, message)
    return error_body(status_code, err_type, message, param)


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape with `status_code`."""

    def __init__(self, status_code: int, err_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.err_type, self.message, self.param = status_code, err_type, message, param


def describe_error(exc: Exception) -> tuple[int, str, str, str | None]:
    """(status, type, message, param) of an exception, in OpenAI's terms."""
    if isinstance(exc, ApiError):
        return exc.status_code, exc.err_type, exc.message, exc.param
    if isinstance(exc, EngineDeadError):
        return 503, "ServiceUnavailableError", f"the engine is dead: {exc}", None
    if isinstance(exc, AdmissionRejectedError):
        return 503, "ServiceUnavailableError", str(exc), None
    if isinstance(exc, RequestParamError):
        return 400, "BadRequestError", str(exc), exc.param
    if isinstance(exc, (ValueError, TypeError)):
        match = _FIELD_IN_MESSAGE.match(str(exc))
        if match:  # "SamplingParams.top_p must be ..." -> param "top_p", "top_p must be ..."
            return 400, "BadRequestError", str(exc)[len("SamplingParams."):], match.group(1)
        return 400, "BadRequestError", str(exc), getattr(exc, "parameter", None)
    if isinstance(exc, RecursionError):  # a structure nested too deeply to walk
        return 400, "BadRequestError", "the request is nested too deeply", None
    return 500, "InternalServerError", f"{type(exc).__name__}: {exc}", None
