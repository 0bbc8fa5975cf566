"""Errors a client of the engine core raises."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone (its process died, stopped answering, or failed in its busy
    loop). Every pending request raises it, and so does every later call."""

    def __init__(self, reason: str = "the engine core died") -> None:
        super().__init__(f"{reason}; this engine can serve no more requests (start a new one)")
        self.reason = reason


class RequestRejectedError(ValueError):
    """The engine core refused a request (e.g. it can never fit the KV cache)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


class EngineStartupError(RuntimeError):
    """The engine-core process failed while starting (loading the model, allocating the KV
    cache ...); the message carries the original error."""
