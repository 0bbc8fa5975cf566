"""Errors a client of the engine core raises, and the helpers that contain a failure to the
request it belongs to (engine core and workers)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")


class VLLMError(Exception):
    """vLLM's base of its own errors (vllm.exceptions), so code written against vLLM can catch them."""


class VLLMClientError(VLLMError):
    """An error the request caused (a server answers it with a 4xx)."""


class VLLMServerError(VLLMError):
    """An error of the engine, not the request (a 5xx)."""


class VLLMValidationError(VLLMClientError, ValueError):
    """A request (its prompt, SamplingParams, PoolingParams, the arguments of `LLM.generate`)
    that fails validation: vLLM's class, and a ValueError as well, so either `except` catches it.
    `parameter` / `value`: vLLM's attributes, set where the field is known; unlike vLLM's, the
    message is left as it is (it already names the field and the value)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class VLLMNotFoundError(VLLMClientError):
    """vLLM's: something a request names does not exist (a server answers 404)."""


class LoRAAdapterNotFoundError(VLLMNotFoundError, ValueError):
    """vLLM's: no LoRA adapter in the folder a LoRARequest names (also a ValueError, as the
    other request checks' errors are)."""

    def __init__(self, lora_name: str, lora_path: str) -> None:
        super().__init__(f"Loading lora {lora_name} failed: No adapter found for {lora_path}")


class ProfilerAlreadyActiveError(VLLMClientError, RuntimeError):
    """vLLM's: start_profile while a session is on (a server answers 409)."""

    def __init__(self) -> None:
        super().__init__("A profiling session is already active. Call /stop_profile before starting another session.")


class AdmissionRejectedError(RuntimeError):
    """vLLM's QueueOverflowError / MaxQueuedTokensError: admitting the request would pass
    max_num_queued_reqs or max_num_queued_tokens (a server answers 503, for a retry elsewhere)."""

    QUEUE_FULL = ("The engine is currently busy and cannot accept new requests. Please try again later or on a "
                  "different instance.")
    TOKENS_FULL = ("The engine has reached its prefill token backlog limit. Please try again later or on a "
                   "different instance.")

    def __init__(self, limit: str) -> None:
        """`limit`: the one it would pass, "max_num_queued_reqs" or "max_num_queued_tokens"."""
        super().__init__(self.QUEUE_FULL if limit == "max_num_queued_reqs" else self.TOKENS_FULL)
        self.limit = limit


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died, stopped answering, or failed in its busy
    loop). Every pending request raises it, and so does every later call."""

    def __init__(self, reason: str = "the engine core died") -> None:
        super().__init__(f"{reason}; this engine can serve no more requests (start a new one)")
        self.reason = reason


class RequestRejectedError(VLLMValidationError):
    """The engine core refused a request (e.g. it can never fit the KV cache), or, with
    `while_running`, a step failed on it after it was admitted (vllm:request_success counts that
    as vLLM's finish reason "error")."""

    def __init__(self, request_id: str, message: str, while_running: bool = False) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.while_running = while_running


class RequestAbortedError(RuntimeError):
    """The request was aborted before it had an output to give (an embedding request)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} was aborted before its output")
        self.request_id = request_id


class EngineStartupError(RuntimeError):
    """The engine-core process failed while starting (loading the model, allocating the KV
    cache ...); the message carries the original error."""


def describe_error(exc: BaseException) -> str:
    """How a contained failure is told to the request's client: the type and the message."""
    return f"{type(exc).__name__}: {exc}"


def run_each_contained(items: Sequence[T], action: Callable[[T], object], req_id: Callable[[T], str],
                       what: str) -> dict[str, str] | None:
    """`action` on every item; an item whose action raises is logged and skipped, and the
    others go on. Returns {request id: why} for the items that failed (None when none did).
    One `try` per call, re-entered only after a failure, so the common path costs nothing per
    item. `what` says in the log where it happened ("while joining the batch")."""
    failed: dict[str, str] | None = None
    start = 0
    while start < len(items):
        index = start
        try:
            for index in range(start, len(items)):
                action(items[index])
            return failed
        except Exception as exc:  # attributable to items[index] alone
            failed_id = req_id(items[index])
            logger.exception("request %r failed %s", failed_id, what)
            failed = failed or {}
            failed[failed_id] = describe_error(exc)
            start = index + 1
    return failed
